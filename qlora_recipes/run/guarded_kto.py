"""objective=kto's trainer: TRL's KTOTrainer under the guards (run/guard.py), with the reward accuracy
TRL does not log for KTO."""

import torch
from trl import KTOTrainer

from .guard import Guarded, drop_ref_adapter, quiet_checkpointing_toggles


class GuardedKTOTrainer(Guarded, KTOTrainer):
    """KTO (objective=kto) under the guards. TRL 1.16's KTOTrainer makes the same "ref" adapter copy as
    DPOTrainer given a PeftModel, and it goes for the same reason (GuardedDPOTrainer). TRL logs no accuracy
    for KTO: `evaluate` adds `rewards/accuracies`, the share of eval rows whose implied reward (beta times
    the policy's minus the reference's log-prob of the completion, TRL's rewards/chosen and
    rewards/rejected per row) has the sign of the row's label: above 0 for a desirable row, below 0 for an
    undesirable one. Strictly, so 0 before training, where the policy is the reference."""

    def __init__(self, *args, **kwargs):
        quiet_checkpointing_toggles()
        super().__init__(*args, **kwargs)
        drop_ref_adapter(self.accelerator.unwrap_model(self.model))

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        figures = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        if eval_dataset is None and self.eval_dataset is not None:
            figures[f"{metric_key_prefix}_rewards/accuracies"] = self.reward_accuracy()
        return figures

    def reward_accuracy(self) -> float:
        """The share of eval rows whose reward has their label's sign (the class docstring)."""
        from trl.trainer.utils import use_adapter

        model, right, total = self.model, 0, 0
        was_training = model.training
        unwrapped = self.accelerator.unwrap_model(model)
        model.eval()
        try:
            with torch.no_grad():
                for batch in self.get_eval_dataloader():
                    batch = self._prepare_inputs(batch)
                    reward = _completion_logps(model, batch)
                    if "ref_logps" in batch:  # precompute_ref_log_probs
                        reward = reward - batch["ref_logps"]
                    else:
                        with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                            reward = reward - _completion_logps(model, batch)
                    label = batch["label"].to(reward.device).bool()
                    right_here = self.accelerator.gather_for_metrics(torch.where(label, reward > 0, reward < 0))
                    right, total = right + int(right_here.sum()), total + right_here.numel()
        finally:
            model.train(was_training)
        return right / max(total, 1)


def _completion_logps(model, batch) -> torch.Tensor:
    """Each row's summed log-prob of its completion tokens, as TRL 1.16's KTOTrainer computes it (the fused
    LM head, the prompt's labels -100)."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=labels,
        use_cache=False,
        fused_lm_head=True,
    )
    return out.log_probs[:, -(batch["input_ids"].size(1) - 1) :].sum(-1)
