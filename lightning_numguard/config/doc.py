"""The class docstring of :class:`~lightning_numguard.doors.trainer.callback.NumGuardCallback`: the contract, the
``--help`` text of LightningCLI and the documentation of every argument (``docs/reference.md`` expands on it).

Kept apart from the class so that ``numguard.py`` reads as the adapter it is; the text keeps the class body's
indentation, as ``__doc__`` would have it.
"""

__all__ = ["DOC"]

# fmt: off
DOC = r"""Check every training step for NaN/Inf, act before the damage lands, and say what went bad first.

    Each step it checks the batch's floating tensors, every watched block's output, the inputs
    of ops that device-assert on bad values, the loss, the gradients, and the parameters and
    buffers (and, optionally, the optimizer state) — all as device-side reductions packed into
    one flag vector that is all-reduced across ranks and read back **once** per optimizer step.
    Names, counts and indices are computed only after a hit.

    Args:
        action: what to do on an incident. ``"warn"``: record and report only. ``"skip"``: the
            optimizer step becomes a no-op (gradients set to ``None``) and buffers changed by the
            bad forward pass are restored; escalates to ``"rollback"`` when the weights or
            optimizer state are no longer finite. ``"rollback"``: restore the last
            verified-finite state in place and carry on; after ``max_rollbacks`` escalate to
            ``"halt"``. ``"halt"``: restore the last finite state, write
            ``<dirpath>/last_finite.ckpt``, and raise ``NonFiniteError`` on every rank (see
            ``halt_raises``).
        dirpath: folder for ``events.jsonl``, ``last_finite.ckpt`` and ``bad_batches/``. Defaults
            to ``<trainer.log_dir>/numguard`` (``<default_root_dir>/numguard`` without a logger).
        check: which sites to check every step, any of ``inputs``, ``outputs``, ``ops``, ``loss``,
            ``grads``, ``buffers``, ``params``, ``optimizer_state``. ``outputs`` watches blocks (see
            ``watch_depth``): one fused min/max per block into a preallocated device buffer; after a
            hit the replay names the exact module and op inside the block. The default leaves out
            two whose work is repeated elsewhere: ``params`` (a NaN weight makes the outputs, loss
            and gradients non-finite, and after any hit the parameters are checked exactly and
            named first; they are also verified before every snapshot and checkpoint) and
            ``optimizer_state`` (verified before every snapshot; add it to catch a poisoned
            Adam moment before the step it would ruin).
        max_abs_input: finite batch values with ``|x|`` at or above this are ``suspicious_input``
            (numpy's masked-array fill value 1e20 and netCDF's 9.96921e36 are caught by the
            default; a value equal to its dtype's own finite extreme, ``torch.finfo(dtype).min`` in
            an additive attention mask, is a mask and does not count); ``None`` turns this off. A
            batch field flagged on 3 consecutive steps with infinities (a mask) is taken for a
            convention of the data: said once, then no longer checked in the fit; flagged on 3
            consecutive steps with anything else (a fill value, a huge value, NaN), it is a broken
            data pipeline and the third step halts with the fix.
        watch_modules: glob patterns of module names whose outputs are watched.
        ignore_modules: glob patterns of module names not watched.
        watch_depth: which modules the ``outputs`` check watches: those at most this many levels
            below the LightningModule (``Sequential``/``ModuleList``/``ModuleDict`` do not count as
            a level), every element of a ``ModuleList``/``ModuleDict`` (repeated blocks; of a list
            of more than 16, every ``ceil(n / 16)``-th and the last), and any module an explicit
            ``watch_modules`` pattern names; ``None`` watches every module.
        check_optimizer_coverage: ``"warn"`` or ``"error"`` on trainable parameters in no optimizer,
            frozen parameters in one, parameters in two groups, trainable parameters that get no
            gradient; ``"off"`` to skip.
        snapshot_every_n_steps: take a verified-finite snapshot every this many clean steps.
        snapshot_device: keep snapshots on the ``"host"`` (pinned when CUDA is used) or on the
            ``"device"``.
        max_rollbacks: rollbacks allowed in one ``fit`` before escalating to ``"halt"``.
        halt_raises: a halt (asked for, or escalated) is a failure: once ``last_finite.ckpt`` is
            written, the events flushed and the loggers finalised as ``"failed"``, ``fit`` raises
            ``NonFiniteError`` on every rank together, whose message says how to resume, so the
            process exits non-zero. ``False``: a graceful stop instead (``trainer.should_stop``;
            ``fit`` returns), except where ``min_steps``/``min_epochs`` would keep Lightning going.
        skip_batches_after_rollback: batches to skip after each rollback (0 = only the bad one).
        lr_backoff: factor applied to every learning rate after each rollback (1.0 = unchanged).
        retry_transient: after a rollback, run the same batch once more from the restored state (under
            the precision plugin's autocast, stepping no optimizer and moving no counter) to judge the
            incident: if it comes out finite it was transient (``retry: transient`` in the event; the
            batch is not trained on and not quarantined), otherwise it is quarantined at once.
        quarantine: skip batch positions that failed twice (or failed a retry) in later epochs and
            after a resume, and save them under ``<dirpath>/bad_batches/``.
        replay: after an incident under ``skip``/``rollback``/``halt``, replay the batch with anomaly
            mode and backward hooks to name the first autograd op and module that went non-finite.
        emit_warnings: emit one ``NumGuardWarning`` per root cause's kind and place (its consequences in
            the same step are recorded, not warned; events, log lines and loggers are written either way).
        sync_mode: ``"every_step"`` reads the step's flags on the host before the optimizer step
            (one host read per step). ``"deferred"`` reads nothing on the step: a bad step is
            skipped on the device through the optimizer's ``found_inf`` (needs one fused optimizer,
            e.g. ``AdamW(..., fused=True)``, automatic optimization and no fp16 GradScaler;
            anything else raises ``NumGuardConfigError`` at fit start), its flags are copied to the
            host without blocking and read one step later, and a rollback or halt is decided then,
            from a snapshot verified before it is needed. Events keep the step of the fault and name
            the watched block and op call, not the leaf module inside the block; ``retry_transient``
            is refused and ``replay`` does not run (see ``docs/performance.md``).
        snapshot_sharding: ``"auto"`` shards snapshots under DDP with more than one rank (every rank
            holds the same weights and optimizer state): each rank keeps only its ``1/world`` of the
            parameters and optimizer states (buffers, schedulers, the scaler, metrics and RNG states
            stay whole and per rank), and a rollback, a halt, the end-of-fit repair and the checkpoint
            swap gather them back from every rank (one all-gather, only on those events). ``"off"``
            keeps a full copy on every rank; use it when the ranks do not hold the same parameters
            and optimizer state. Under ``ModelParallelStrategy`` (FSDP2, tensor parallel) the state is
            already sharded: each rank copies only its local shards, never re-sharded, restored in place with
            no collective. ``sync_mode="deferred"`` shards its ring of snapshots the same way.
        snapshot_async: take snapshots asynchronously: from the start of a step whose snapshot is due, the
            parameters and optimizer state are copied on a CUDA side stream (on the CPU: a worker thread),
            overlapped with the forward and backward passes, into a second snapshot buffer; the copy becomes
            the snapshot only once the step's read verified the state finite, and the optimizer step waits
            for it on the device (no host stall). Costs a second snapshot buffer while on (twice the
            snapshot's host memory). ``None`` (default): on when the LightningModule is on CUDA and
            ``snapshot_device="host"``, off on the CPU (a worker thread competes with compute on small
            machines); ``True`` forces it; ``sync_mode="deferred"`` keeps its own synchronous snapshots.
        spike_action: what to do when the loss or the global gradient norm is finite but far above its recent
            range (see ``docs/reference.md``, "Spikes"). ``None`` (default): the statistics are kept and logged,
            no event is recorded. ``"warn"``: record ``loss_spike`` / ``grad_norm_spike`` events. ``"skip"``:
            the step is skipped atomically like a non-finite one (in ``sync_mode="deferred"``: on the device,
            through ``found_inf``); the ``spike_rollback_after``-th spike within ``spike_window`` steps rolls
            back instead. ``"rollback"``: every spike rolls back to the last snapshot (with
            ``skip_batches_after_rollback`` and ``lr_backoff``; a rollback landing again on a snapshot
            already restored for the same trouble is a repeat: the LR schedule keeps its place, so the
            scheduled steps that blew up are not run again; ``snapshot_every_n_steps=5`` keeps each
            rollback short). Needs ``action`` other than ``"warn"`` to act.
        spike_sigma: a value spikes when its cube root is more than this many robust standard deviations
            (the upper-half MAD, at least 5 % of the centre) above the median of the window's cube roots
            (10: no false spike in 20,000 clean steps of five real clients at batches of 2 to 8).
        spike_window: steps in the rolling window of the loss and the global gradient norm, kept on the device
            (0: no spike statistics, and the gradients are checked without computing their norm).
        spike_warmup: valid values the window needs before it judges; ``None``: 16 (or half a shorter
            window). Fit start says when detection arms, and warns when ``max_steps`` ends the fit first.
        spike_rollback_after: under ``spike_action="skip"``, this many spikes within ``spike_window`` steps make
            the last one a rollback (0: never).
        overflow_headroom: a watched block whose output peak comes within this factor of its dtype's largest
            finite value (float16 65504; bfloat16 and float32 3.4e38) is reported once as ``overflow_risk``;
            ``None`` turns it off. A collapsing fp16 loss scale is reported as ``overflow_risk`` too.
        extra_checks: checks of your own, each a subclass of ``lightning_numguard.Check`` in one file (its kind,
            hint, where it records, its 0-d device value and its findings): each is folded into the step's one
            read, judged like a built-in check (acted on, or only reported when ``advisory``) and written to the
            events. In a LightningCLI YAML file: ``class_path`` and ``init_args``. See ``ARCHITECTURE.md``.

    Raises:
        NumGuardConfigError: at construction, for any invalid argument.
        NonFiniteError: when the guard halts (``action="halt"``, or escalated from ``"rollback"``),
            after the last finite state was saved (with ``halt_raises=False``: only when
            ``min_steps``/``min_epochs`` would keep Lightning going); and at fit start when the
            initial weights are not finite (except under ``"warn"``).

    Logged (TensorBoard tags; other loggers get the scalars). Scalars are written on the steps
    Lightning writes your metrics (``(step + 1) % log_every_n_steps == 0``, in the same call) and
    at every step that had an event (a counter when it moved):

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

    Example::

        from pytorch_lightning import Trainer
        from lightning_numguard import NumGuardCallback

        trainer = Trainer(callbacks=[NumGuardCallback(action="rollback", lr_backoff=0.5)])
    """
# fmt: on
