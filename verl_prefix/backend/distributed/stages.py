"""Pipeline stages under the one schedule, for every engine that splits its model into stages (``prefix_torchtitan``,
``prefix_megatron``): one rank holds one stage (the embeddings and the first layers, then more layers, the last one
ending with the norm and the LM head), and activations and their gradients cross stages by point-to-point sends over
the engine's pipeline process group.

Neither engine's pipelined schedule knows phase A's prefix, which is one forward with no backward of its own, or
phase C's backward, which starts inside every stage at once. So every stage runs the one schedule
(``schedule.executor`` / ``schedule.tree.schedule``) on its own model part, and the stage's model call (the engine's
``causal_lm``) does the crossing (``docs/design.md``, "Pipeline parallelism"):

- a call's input on a stage after the first is the previous stage's output (``StageLink.receive``), a leaf whose
  gradient goes back to that stage as soon as a backward computes it;
- a call on a stage before the last sends its output on and returns a ``StageHandoff`` instead of logits
  (``schedule.kv.shim.Handoff``): no loss runs there. Phase B backpropagates a node's handoffs once all its
  micro-batches went forward (GPipe order), each seeded with the gradient the next stage sent back; phase C's
  seeded backward of a node takes its phase-A output with the next stage's gradient as one more root. Every
  stage runs the same steps in the same order (``check_same``), so each receive matches a send.

Sends are non-blocking (waited at ``flush``) so that no stage waits on a peer that waits on it. Dense rows, and a
data-parallel peer's lockstep fillers, run as pipeline micro-batches (``run_micro_batches``: the engine's own inputs
and loss on the last stage).

Virtual stages (megatron-core's interleaved pipeline: ``chunks`` model chunks per rank, the model cut into
``ranks x chunks`` pieces taken round-robin, so a sequence goes around the ring of ranks ``chunks`` times): a rank's
call runs its chunks in order, and between two of them its output goes on to the next rank while the next chunk's
input comes from the previous rank around the ring (``relay``: an autograd function, so its backward sends the
input's gradient back and waits for the output's). A backward then crosses the ring inside autograd, and a rank may
wait in it for a peer's backward of the same micro-batch: every stage backpropagates each micro-batch right after
its forward (``interleaved``: the handoffs are ``eager``) instead of after the node's last forward, and phase C's one
seeded backward on each rank reaches its earlier chunks through the relays in autograd's dependency order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verl_prefix.backend.inputs import uids_of

# activation dtypes a header can name (index in this tuple)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # ndim, up to 6 sizes, dtype index


@dataclass
class StageStep:
    """One pipeline micro-batch on this rank's stage.

    ``first_input``: what the first stage feeds its model part (token ids); ``forward``: this stage's model part
    on its input, inside whatever contexts the step needs (serving prefix leaves, MoE counting); ``score``: on the
    last stage, the micro-batch's loss from the output (recording its outputs), or None when nothing is
    backpropagated."""

    first_input: torch.Tensor
    forward: Callable[[torch.Tensor], torch.Tensor]
    score: Callable[[torch.Tensor], torch.Tensor | None]


@dataclass
class StageLink:
    """This rank's place in the pipeline and its point-to-point links to the neighbouring stages."""

    stage: int = 0
    num_stages: int = 1
    group: Any = None
    ranks: Sequence[int] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pending: list = field(default_factory=list)
    chunks: int = 1  # model chunks per rank (virtual stages), each sequence crossing the ring ``chunks`` times

    @classmethod
    def of_mesh(cls, mesh: Any, device: torch.device) -> StageLink:
        """The link over torchtitan's ``pp`` device mesh (None: one stage, no pipeline)."""
        if mesh is None or mesh.size() == 1:
            return cls(device=device)
        group = mesh.get_group()
        return cls(mesh.get_local_rank(), mesh.size(), group, dist.get_process_group_ranks(group), device)

    @classmethod
    def of_group(cls, group: Any, device: torch.device, chunks: int = 1) -> StageLink:
        """The link over a pipeline process group (megatron-core's; None or one rank: one stage, no pipeline), with
        ``chunks`` model chunks per rank (virtual stages)."""
        if group is None or dist.get_world_size(group) == 1:
            return cls(device=device)
        ranks = dist.get_process_group_ranks(group)
        return cls(ranks.index(dist.get_rank()), len(ranks), group, ranks, device, chunks=chunks)

    @property
    def interleaved(self) -> bool:
        """Virtual stages: a backward crosses the ring inside autograd, so each micro-batch is backpropagated
        right after its forward on every stage."""
        return self.chunks > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # -- point to point -------------------------------------------------------------------------------

    def _isend(self, tensor: torch.Tensor, stage: int) -> None:
        tensor = tensor.detach().contiguous()
        self.pending.append((dist.isend(tensor, dst=self.ranks[stage % self.num_stages], group=self.group), tensor))

    def send_activation(self, tensor: torch.Tensor) -> None:
        """To the next stage (around the ring: the last stage's next is the first), behind a header with its shape
        and dtype (the receiver allocates from it)."""
        if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
            raise ValueError(f"pipeline stages: cannot send a {tensor.dtype} activation of shape {tuple(tensor.shape)}")
        header = torch.zeros(_HEADER, dtype=torch.long, device=self.device)
        header[0] = tensor.dim()
        header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape)
        header[-1] = _DTYPES.index(tensor.dtype)
        self._isend(header, self.stage + 1)
        self._isend(tensor, self.stage + 1)

    def recv_activation(self, requires_grad: bool) -> torch.Tensor:
        """From the previous stage (around the ring): a leaf that collects this stage's gradient w.r.t. its
        input."""
        src = self.ranks[(self.stage - 1) % self.num_stages]
        header = torch.empty(_HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, src=src, group=self.group)
        shape = header[1 : 1 + int(header[0])].tolist()
        tensor = torch.empty(shape, dtype=_DTYPES[int(header[-1])], device=self.device)
        dist.recv(tensor, src=src, group=self.group)
        return tensor.requires_grad_(requires_grad)

    def send_grad(self, received: torch.Tensor) -> None:
        """The gradient this stage's backward left on ``received`` (its input), to the previous stage."""
        self._send_back(received.grad if received.grad is not None else torch.zeros_like(received))

    def recv_grad(self, output: torch.Tensor) -> torch.Tensor:
        """The gradient of ``output`` (sent on to the next stage) that the next stage computed."""
        return self._recv_from_next(output.shape, output.dtype, output.device)

    def _recv_from_next(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        grad = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(grad, src=self.ranks[(self.stage + 1) % self.num_stages], group=self.group)
        return grad

    def relay(self, output: torch.Tensor) -> torch.Tensor:
        """Between two of this rank's model chunks: ``output`` on to the next rank, the next chunk's input from the
        previous rank (around the ring); differentiable (``_Relay``)."""
        return _Relay.apply(output, self)

    def receive(self, requires_grad: bool) -> torch.Tensor:
        """A schedule call's input on a stage after the first: the previous stage's output, whose gradient goes
        back as soon as a backward computes it (phase B's micro-batch, phase C's node)."""
        received = self.recv_activation(requires_grad)
        if requires_grad:
            received.register_hook(self._send_back)
        return received

    def _send_back(self, grad: torch.Tensor) -> None:
        self._isend(grad, self.stage - 1)

    def hand_off(self, output: torch.Tensor) -> StageHandoff:
        """A schedule call's output on a stage before the last: sent on; the next stage scores it."""
        self.send_activation(output)
        return StageHandoff(self, output, eager=self.interleaved)

    def flush(self) -> None:
        """Wait for every send in flight (their tensors stay alive until then)."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

    # -- the schedule ---------------------------------------------------------------------------------

    def forward(self, step: Callable[[torch.Tensor], Any], first_input: torch.Tensor, requires_grad: bool) -> tuple:
        """One forward through this stage: the input (``first_input`` on the first stage, else received) and
        what ``step`` returned, sent on to the next stage unless this is the last."""
        inputs = first_input if self.is_first else self.recv_activation(requires_grad)
        output = step(inputs)
        if not self.is_last:
            self.send_activation(output)
        return inputs, output

    def gather_named(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stage's ``(name, tensor)`` pairs on every stage, stage by stage, one tensor at a time: verl's
        weight sync (``get_per_tensor_param``) yields the rank's own parameters only, and a rollout fed one
        stage's weights would keep the other stages' old ones. A collective: every stage iterates to the end."""
        if self.num_stages == 1:
            yield from named
            return
        for stage in range(self.num_stages):
            src = self.ranks[stage]
            if stage == self.stage:
                for name, tensor in named:
                    tensor = tensor.detach().contiguous()
                    meta = [(name, tuple(tensor.shape), tensor.dtype)]
                    dist.broadcast_object_list(meta, src=src, group=self.group, device=self.device)
                    dist.broadcast(tensor, src=src, group=self.group)
                    yield name, tensor
                dist.broadcast_object_list([None], src=src, group=self.group, device=self.device)
                continue
            while True:
                box: list = [None]
                dist.broadcast_object_list(box, src=src, group=self.group, device=self.device)
                if box[0] is None:
                    break
                name, shape, dtype = box[0]
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(tensor, src=src, group=self.group)
                yield name, tensor

    def check_same(self, value: Any, what: str) -> None:
        """Every stage must run the same plan (verl gives the ranks of a pipeline the same rows): a stage that
        does not would send activations of other shapes, or wait forever. One object all-gather; every stage
        raises together."""
        if self.num_stages == 1:
            return
        values: list = [None] * self.num_stages
        dist.all_gather_object(values, value, group=self.group)
        if any(v != values[0] for v in values):
            raise ValueError(f"the pipeline stages hold different {what}: {values}")

    def share(self, payload: Any) -> Any:
        """The last stage's ``payload`` on every stage (verl reads outputs from the last stage; tests and the
        worker's metrics read them anywhere)."""
        if self.num_stages == 1:
            return payload
        box = [payload if self.is_last else None]
        dist.broadcast_object_list(box, src=self.ranks[-1], group=self.group, device=self.device)
        return box[0]


class _Relay(torch.autograd.Function):
    """``StageLink.relay``: forward sends the chunk's output on and receives the next chunk's input; backward sends
    that input's gradient back and receives the output's (from the rank the output went to)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, link: StageLink) -> torch.Tensor:
        ctx.link, ctx.shape, ctx.dtype = link, output.shape, output.dtype
        link.send_activation(output)
        return link.recv_activation(False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.link._send_back(grad)
        return ctx.link._recv_from_next(ctx.shape, ctx.dtype, grad.device), None


@dataclass
class StageHandoff:
    """``schedule.kv.shim.Handoff`` on a stage before the last: ``output`` went to the next stage. ``eager``: its
    backward runs right after the forward (virtual stages, ``StageLink.interleaved``)."""

    link: StageLink
    output: torch.Tensor
    eager: bool = False

    def backward(self) -> None:
        """Phase B: this stage's part of the micro-batch's backward, seeded with the next stage's gradient."""
        torch.autograd.backward(self.output, self.link.recv_grad(self.output))

    def roots(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Phase C: the node's output and the gradient of it the next stage's phase C sent back."""
        return [(self.output, self.link.recv_grad(self.output))]


def batch_fingerprint(data: Any) -> str:
    """A short hash of a mini-batch's rows (token ids, row lengths, uids), for ``StageLink.check_same``."""
    ids = data["input_ids"]
    digest = hashlib.sha1()
    for tensor in (ids.values(), ids.offsets()) if ids.is_nested else (ids,):
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    if "uid" in data.keys():
        digest.update(repr(uids_of(data)).encode())
    return digest.hexdigest()[:16]


def run_micro_batches(link: StageLink, steps: Sequence[StageStep], backward: bool) -> None:
    """Pipeline micro-batches in GPipe order: every forward, then (``backward``) every backward in the same
    order (under virtual stages each right after its forward). The last stage backpropagates each micro-batch's loss
    as soon as it has it."""
    kept = []
    for step in steps:
        inputs, output = link.forward(step.forward, step.first_input, backward)
        if link.is_last:
            loss = step.score(output)
            if backward and loss is not None:
                loss.backward()
                if not link.is_first:
                    link.send_grad(inputs)
        elif backward:
            kept.append((inputs, output))
        if link.interleaved:
            _backward_kept(link, kept)
    _backward_kept(link, kept)
    link.flush()


def _backward_kept(link: StageLink, kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The kept micro-batches' backward on a stage before the last, seeded with the next stage's gradients."""
    for inputs, output in kept:
        torch.autograd.backward(output, link.recv_grad(output))
        if not link.is_first:
            link.send_grad(inputs)
    kept.clear()
