"""The step's status: layer-call failures reported without a host sync, raised on every rank once per step.

A layer call that checks its arguments (and, under ``plan.check_modules``, what its compressor
and indexer returned) can fail on one rank only. Raising there at once would leave the other
ranks waiting in the call's collectives, and agreeing at once costs a host read per call. With
a :class:`StepStatus` passed to :func:`cpkv.attention_forward` (``status=``), a rank whose
check fails records the failure here, on its host, and goes on: it takes part in every
collective of the call with placeholders of the planned shapes filled with NaN and returns a
NaN output, so whatever depends on it (its own results, the rows it sends, the gradients it
sends back) is poisoned. No host read happens in the layer call. Once per step, before the
optimizer may step, every rank calls :meth:`StepStatus.check`: one all-reduce of two int64
and one host read (:func:`cpkv.agreement.agree`); when some rank recorded a failure, every
rank raises, the failing rank its own error and the others the same kind naming it.

The status is an explicit object made by the caller (no module-level state). It is a plain
class, not a dataclass or container, so wrappers that rebuild a forward's arguments (FSDP's
input casting, DDP's device move) pass it through unchanged and the caller's object sees
every report.
"""

from __future__ import annotations

from cpkv.agreement import agree
from cpkv.collectives import Group, check_group

__all__ = ["StepStatus"]


class StepStatus:
    """This rank's layer-call failures of one training step, raised on every rank by :meth:`check`.

    Make one per step (or per micro-batch) on every rank of the CP group, pass it to every
    layer call of the step (``attention_forward(..., status=status)``, ``V4Attention(...,
    status=status)``), and call :meth:`check` on every rank after the forward and before
    ``optimizer.step()``. The integrations do this themselves
    (:func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss` checks after its
    forward; Megatron: :func:`~cpkv.integrations.megatron_attention.with_plan` carries one).

    Args:
        group: the CP group the calls run on (``None``: the default group).
        each_call: debugging: every layer call agrees on its checks at once (a host read per
            call and one more per compressed call) and raises on every rank inside the call,
            as without a status but with one rank's bad argument raised on every rank too.

    Attributes:
        calls: layer calls reported since the last :meth:`check` (numbered from 1 in the
            order they ran, activation recomputation included; not counted while
            ``torch.compile`` traces).
        error: this rank's first failure since the last :meth:`check` (later ones are its
            consequences), its message naming the layer call; ``None`` when none.

    Example:
        >>> status = StepStatus()  # doctest: +SKIP
        >>> out = attention_forward(q, kv, plan, group, spec=spec, status=status).out  # doctest: +SKIP
        >>> loss_fn(out).backward()  # doctest: +SKIP
        >>> status.check()  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
    """

    def __init__(self, group: Group = None, *, each_call: bool = False) -> None:
        self.group = check_group("group", group)
        if not isinstance(each_call, bool):
            raise TypeError(f"each_call must be a bool, got {type(each_call).__name__}")
        self.each_call = each_call
        self.calls = 0
        self.error: Exception | None = None

    def __repr__(self) -> str:
        state = "ok" if self.error is None else f"failed: {self.error}"
        return f"StepStatus(calls={self.calls}, {state})"

    def start_call(self) -> int:
        """Count a layer call; returns its number (1-based)."""
        self.calls += 1
        return self.calls

    def report(self, error: Exception, call: str) -> None:
        """Record this rank's failure in ``call`` (a description such as ``"layer call 3 (INDEXER, ...)"``); the first one is kept."""
        if self.error is None:
            if isinstance(error, (ValueError, TypeError)):
                self.error = (ValueError if isinstance(error, ValueError) else TypeError)(f"{call}: {error}")
            else:  # what a user's module raised: named, as a RuntimeError
                self.error = RuntimeError(f"{call}: {type(error).__name__}: {error}")
            self.error.__cause__ = error

    def check(self) -> None:
        """Collective: raise on every rank of the group if any rank recorded a failure; then reset.

        Every rank of the group must call it at the same point. Costs one all-reduce (MAX) of
        two int64 and one host read; the failing rank's message is broadcast only on failure.

        Raises:
            ValueError, TypeError, RuntimeError: the failing rank raises its recorded error
                (the kind of the failed check; ``RuntimeError`` for an error a module raised);
                every other rank the same kind, ``"rank r of the group failed, so every rank
                raises: <kind>: layer call k (...): <message>"``.
        """
        error, self.error, self.calls = self.error, None, 0
        agree(error, self.group)
