"""objective=dpo's trainer: TRL's DPOTrainer under the guards (run/guard.py)."""

from trl import DPOTrainer

from .guard import Guarded, drop_ref_adapter, quiet_checkpointing_toggles


class GuardedDPOTrainer(Guarded, DPOTrainer):
    """DPO (objective=dpo) under the guards. Given a PeftModel and no ref_model, TRL 1.16 adds a "ref"
    adapter, a copy of the adapter as it is at construction, and scores the reference with it; without
    that adapter, with the adapter off. Ours start at peft's initialisation (LoRA B = 0: the base
    itself) or at an earlier stage's adapter (init_from). The reference is the base with the adapter
    off unless `ref_adapter` (objective.ref_adapter=true): then it is the copy, the earlier stage's
    adapter frozen (its LoRA weights beside ours, no second base). A copy not wanted goes before TRL
    uses it (also before precompute_ref_log_probs scores the reference); a kept one is never saved
    (checkpoints and adapter/ hold one adapter), and each new trainer (the OOM ladder's, a resume's)
    copies it afresh from the adapter as train_with_oom_ladder hands it over: the initial one."""

    def __init__(self, *args, ref_adapter: bool = False, **kwargs):
        quiet_checkpointing_toggles()
        self._ref_adapter = ref_adapter
        drop_ref_adapter(kwargs.get("model"))  # an earlier trainer's copy (the OOM ladder): TRL copies anew
        super().__init__(*args, **kwargs)
        if not self._ref_adapter or self.precompute_ref_logps:  # precomputed: scored by now, not needed per step
            drop_ref_adapter(self.accelerator.unwrap_model(self.model))

    def _precompute_ref_logps(self, *args, **kwargs):
        if not self._ref_adapter:  # the base with the adapter off scores the reference
            drop_ref_adapter(self.accelerator.unwrap_model(self.model))
        return super()._precompute_ref_logps(*args, **kwargs)

    def _save(self, output_dir=None, state_dict=None):
        model = self.accelerator.unwrap_model(self.model)
        ref = getattr(model, "peft_config", {}).pop("ref", None)  # peft saves every adapter it lists
        try:
            return super()._save(output_dir, state_dict)
        finally:
            if ref is not None:
                model.peft_config["ref"] = ref
