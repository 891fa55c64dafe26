"""gloo for stages on a GPU: every tensor goes through host memory (distributed/staging.py).

No GPU here, so the staging is checked three ways: its decisions on a tensor that is not on the
host (PyTorch's ``meta`` device: a receive gets a host buffer, a send must be copied out);
``Handle``'s copy of a received buffer into the consumer's tensor, after the wait and once; and
real gloo processes with ``copy_always`` (every tensor posted is a distinct host copy, every
receive lands in a separate host buffer and is copied over after its wait), whose numbers must
still be the emulator's, bit for bit: a copy skipped or made before the data arrived would
change them.
"""

from __future__ import annotations

import pytest
import torch

from _api_reference import run_pipeline
from nobubble.runtime.distributed.staging import HOST, inbound, outbound
from nobubble.runtime.distributed.waits import Handle
from test_api_dist import launch, problems

META = torch.device("meta")


def test_a_host_tensor_travels_as_it_is():
    t = torch.arange(6.0)
    assert outbound(t) is t
    assert inbound(t) == (t, None)


def test_a_tensor_off_the_host_is_received_in_a_host_buffer_then_copied_over():
    consumer = torch.empty(3, 5, dtype=torch.bfloat16, device=META)
    buffer, arrival = inbound(consumer)
    assert buffer.device == HOST and buffer.shape == consumer.shape
    assert buffer.dtype == torch.bfloat16
    assert arrival is not None and arrival[0] is consumer and arrival[1] is buffer


def test_a_tensor_off_the_host_is_copied_to_the_host_before_it_is_sent():
    # a meta tensor has no data to copy: the attempt is what shows the copy is made
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        outbound(torch.empty(4, device=META))


def test_copy_always_stages_host_tensors_through_distinct_buffers():
    t = torch.arange(6.0)
    sent = outbound(t, always=True)
    assert sent is not t and sent.data_ptr() != t.data_ptr() and torch.equal(sent, t)
    buffer, arrival = inbound(t, always=True)
    assert buffer.data_ptr() != t.data_ptr() and arrival == (t, buffer)


def test_a_received_buffer_reaches_its_consumer_after_the_wait_and_only_once():
    consumer, buffer = torch.zeros(4), torch.arange(4.0)
    handle = Handle([], on_cuda=False)
    handle.arrivals.append((consumer, buffer))
    assert torch.equal(consumer, torch.zeros(4))  # nothing before the wait
    handle.wait(1.0, "a receive")
    assert torch.equal(consumer, torch.arange(4.0))
    buffer.fill_(7.0)  # a second wait (a batch carrying several messages) copies nothing again
    handle.wait(1.0, "a receive")
    assert torch.equal(consumer, torch.arange(4.0)) and handle.arrivals == []


STEPS, DRAIN = 4, 2
RANK_SCRIPT = """
import json, sys, torch
import nobubble, problems
from _api_reference import run_pipeline, adamw
from nobubble.runtime.distributed import staging
staging.HostStaged.copy_always = True  # every tensor through a separate host copy, as on a GPU
steps, drain, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
seq, saved = problems.PROBLEMS["seq"], {}
for schedule, options in [("1f1b", {"clip": 0.5}), ("paci", {})]:  # P = 4
    pipe, losses, _ = run_pipeline(seq, schedule, 4, steps, drain, runtime="dist",
                                   backend="gloo", timeout=60, **options)
    saved[schedule] = {
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in pipe.stages[pipe.rank].named_parameters()},
        "val": pipe.evaluate(*seq.batch(99)),
        "transport": type(pipe.emulator.transport).__name__,
    }
# P = 2 x D = 2: the dp all-reduce through host buffers too
pipe = nobubble.Pipeline(seq.cut(seq.make_model(), 2), seq.loss_fn, schedule="1f1b",
                         microbatches=4, optimizer=adamw, runtime="dist", backend="gloo",
                         data_parallel=2, timeout=60)
for j in range(steps):
    pipe.step(*(pipe.shard(t) for t in seq.batch(j)))
pipe.drain()
saved["dp"] = {n: p.detach().clone() for n, p in pipe.stages[pipe.rank].named_parameters()}
torch.save(saved, f"{out}/rank{torch.distributed.get_rank()}.pt")
pipe.close()
"""


def test_gloo_through_host_copies_gives_the_emulators_numbers(tmp_path):
    """Four gloo processes, every transfer staged through host copies: the point-to-point
    messages, the global-norm gather (1f1b with clipping), the evaluation traffic and, at P=2 x
    D=2, the dp all-reduce."""
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    launch(tmp_path, 4, [str(tmp_path / "rank.py"), str(STEPS), str(DRAIN), str(tmp_path)])
    torch.set_num_threads(1)
    seq = problems()["seq"]
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for schedule, options in [("1f1b", {"clip": 0.5}), ("paci", {})]:
        pipe, losses, _ = run_pipeline(seq, schedule, 4, STEPS, DRAIN, **options)
        assert [p[schedule]["transport"] for p in parts] == ["StagedTreeTransport"] * 4
        assert parts[-1][schedule]["losses"] == losses, schedule
        assert [p[schedule]["val"] for p in parts[:-1]] == [None] * 3
        assert parts[-1][schedule]["val"] == pipe.evaluate(*seq.batch(99))
        for rank, part in enumerate(parts):
            ours = {n: p.detach() for n, p in pipe.stages[rank].named_parameters()}
            theirs = part[schedule]["weights"]
            assert theirs.keys() == ours.keys()
            assert all(torch.equal(theirs[n], v) for n, v in ours.items()), (schedule, rank)
    # the replicas average the same gradients: bitwise equal to each other, and equal to one
    # pipeline of twice the micro-batch up to the order of the average's additions
    pipe, _, _ = run_pipeline(seq, "1f1b", 2, STEPS, None)
    for rank in (0, 1):
        replica0, replica1 = parts[rank]["dp"], parts[2 + rank]["dp"]
        assert all(torch.equal(replica0[n], replica1[n]) for n in replica0)
        for name, value in pipe.stages[rank].named_parameters():
            assert torch.allclose(replica0[name], value.detach(), atol=1e-6), name
