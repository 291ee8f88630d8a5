"""The loss settings the tests sweep, read live from losses.LossConfig, losses.LOSSES and losses.CHOICES, so a field or
a loss type added later is checked without editing a test: tests/test_losses.py against its float64 reference,
tests/dist_invariance.py across ranks and micro-batches."""
import dataclasses

import losses


def sweep(flags, max_completion_length):
    """{case name: LossConfig}: every LossConfig field at a value other than its value in `flags`, on each loss type
    that reads it (LOSSES' `reads`; a field no entry declares: dapo and grpo), every choice of a string field (so every
    LOSSES entry); Dr. GRPO's denominator filled in as grpo.update does."""
    cases = {}
    for f in dataclasses.fields(losses.LossConfig):
        base = getattr(flags, f.name)
        choices = {"loss_type": tuple(losses.LOSSES), **losses.CHOICES}  # every loss type, read live
        if f.name in choices:
            values = [v for v in choices[f.name] if v != base]
        elif isinstance(base, bool):
            values = [not base]
        elif base is None:
            values = [8 if "int" in str(f.type) else 1.05]
        else:
            values = [base * 2 if isinstance(base, int) else base * 0.5 if base else 0.1]
        readers = [lt for lt, e in losses.LOSSES.items() if f.name in e.get("reads", ())] or ["dapo", "grpo"]
        for v in values:
            for lt in ([v] if f.name == "loss_type" else readers):
                cfg = dataclasses.replace(flags, loss_type=lt, **({} if f.name == "loss_type" else {f.name: v}))
                stray = {g for e in losses.LOSSES.values() for g in e.get("reads", ())} - set(
                    losses.LOSSES[lt].get("reads", ())) - {f.name}  # flags' clip range where lt has none
                cfg = dataclasses.replace(cfg, **{g: getattr(losses.LossConfig(), g) for g in stray})
                losses.validate_loss_config(cfg)  # a case the flags accept
                cases[f"{f.name}={v}" + ("" if f.name == "loss_type" else f"@{lt}")] = dataclasses.replace(
                    cfg, max_completion_length=cfg.max_completion_length or max_completion_length)
    return cases
