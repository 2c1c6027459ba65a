"""The class docstring of :class:`~lightning_numguard.doors.trainer.callback.NumGuardCallback`: the contract, the
``--help`` text of LightningCLI and the documentation of every argument (``docs/reference.md`` expands on it).

Its ``Args:`` section is made from the arguments' declarations (:class:`~lightning_numguard.config.arguments.
GuardConfig`), each group's fields under it; the rest is written here. The text keeps the class body's indentation,
as ``__doc__`` would have it.
"""

from __future__ import annotations

import textwrap

from lightning_numguard.config.arguments import GuardConfig

__all__ = ["DOC", "args_section"]


def args_section(config: type[GuardConfig] = GuardConfig, indent: str = "    ") -> str:
    """The ``Args:`` section of a door's docstring: one entry per declared argument (a group's fields are documented
    in the group's own docstring, which LightningCLI shows under the group's keys; a flat name kept from before the
    groups says where it moved)."""
    lines = [f"{indent}Args:"]
    for name, arg in config.__arguments__.items():  # a group's fields: in the group's own docstring
        lines += _entry(name, arg.doc, indent * 2)
    return "\n".join(lines) + "\n"


def _entry(name: str, doc: str, indent: str) -> list[str]:
    text = f"{name}: {doc}."
    return textwrap.wrap(text, width=112, initial_indent=indent, subsequent_indent=indent + "    ")


_INTRO = r"""Check every training step for NaN/Inf, act before the damage lands, and say what went bad first.

    Each step it checks the batch's floating tensors, every watched block's output, the inputs
    of ops that device-assert on bad values, the loss, the gradients, and the parameters and
    buffers (and, optionally, the optimizer state) — all as device-side reductions packed into
    one flag vector that is all-reduced across ranks and read back **once** per optimizer step.
    Names, counts and indices are computed only after a hit.
    """

_REST = r"""    Raises:
        NumGuardConfigError: at construction, for any invalid argument.
        NonFiniteError: when the guard halts (``action="halt"``, or escalated from ``"rollback"``),
            after the last finite state was saved (with ``halt_raises=False``: only when
            ``min_steps``/``min_epochs`` would keep Lightning going); and at fit start when the
            initial weights are not finite (except under ``"warn"``).

    Logged (TensorBoard tags; other loggers get the scalars). Scalars go to the loggers directly
    (as ``LearningRateMonitor``'s, never into ``trainer.callback_metrics``, ``logged_metrics`` or
    ``progress_bar_metrics``) on the steps Lightning writes your metrics (``(step + 1) %
    log_every_n_steps == 0``, at its step number) and at every step that had an event (a counter
    when it moved):

    ==============================  =====================================================
    ``numguard/incidents``          incidents recorded so far (scalar)
    ``numguard/skipped_steps``      optimizer steps turned into no-ops (scalar)
    ``numguard/rollbacks``          rollbacks so far (scalar)
    ``numguard/amp_overflow_steps`` steps the AMP GradScaler skipped itself (scalar; only under
                                    a GradScaler, every step with your metrics)
    ``numguard/loss_scale``         the GradScaler's loss scale (scalar, likewise)
    ``numguard/events``             one markdown paragraph per incident (text)
    ``numguard/spikes``             loss and gradient-norm spikes so far (scalar)
    ``numguard/grad_norm``          the global L2 norm of the gradients (scalar; with spike
                                    statistics on; also at a step above the threshold)
    ``numguard/loss_zscore``        the loss's robust z-score against the window (scalar,
                                    after the warm-up)
    ``numguard/grad_norm_zscore``   the gradient norm's z-score, likewise
    ``numguard/spike_threshold``    the z-score that makes a spike (``spike_sigma``)
    ``numguard/run``                the run's picture (image), at the end of a fit that had
                                    any event (or a halt); needs matplotlib (``[plot]``)
    ==============================  =====================================================

    Across ranks: input, output, op and loss flags are local and carry the rank into the one
    all-reduce, so every rank takes the same decision in the same step; files and loggers are
    written by global rank 0; ``trainer.save_checkpoint`` is called on every rank.

    Example (with ``Trainer`` from ``pytorch_lightning`` and ``NumGuardCallback`` from ``lightning_numguard``)::

        trainer = Trainer(callbacks=[NumGuardCallback(action="rollback", lr_backoff=0.5)])
    """

DOC = _INTRO + "\n" + args_section() + "\n" + _REST
