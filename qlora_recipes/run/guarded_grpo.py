"""objective=grpo's trainer: TRL's GRPOTrainer under the guards (run/guard.py), its rewards checked."""

import logging
from pathlib import Path

from trl import GRPOTrainer

from . import rewards
from .checkpoints import find_checkpoint
from .guard import Guarded, drop_ref_adapter, quiet_checkpointing_toggles
from .preemption import Preempted, PreemptionCallback

log = logging.getLogger(__name__)


class GuardedGRPOTrainer(Guarded, GRPOTrainer):
    """GRPO (objective=grpo) under the guards. With beta > 0 and a PeftModel TRL 1.16 adds a "ref"
    adapter, a copy of ours at construction, and scores the reference with it; ours start at peft's
    initialisation (the base itself), so, as for DPO, the copy goes and the reference is the base with
    the adapter off (TRL's `use_adapter(model, None)` when no "ref" adapter exists). beta = 0: no copy,
    no reference forward. A reward's fault (rewards.CheckedReward) stops the run at the step it appears,
    before that step's update; a stop signal that comes while a reward hangs stops it as a preemption."""

    def __init__(self, *args, **kwargs):
        quiet_checkpointing_toggles()  # TRL's generation toggles checkpointing as DPO's reference forward does
        super().__init__(*args, **kwargs)
        drop_ref_adapter(self.accelerator.unwrap_model(self.model))
        stops = [cb for cb in self.callback_handler.callbacks if isinstance(cb, PreemptionCallback)]
        for func in self.reward_funcs:
            if stops and isinstance(func, rewards.CheckedReward):
                func.stop_requested = lambda cb=stops[0]: cb.received

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        step = self.state.global_step + 1
        try:
            per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            rewards.refuse_unscored(self.reward_funcs, prompts, completions, step)
        except rewards.RewardFault as fault:
            kept = find_checkpoint(Path(self.args.output_dir))
            where = f"its newest checkpoint ({kept}) is kept" if kept else "no checkpoint was saved yet"
            raise rewards.RewardFault(f"{fault}; the run stopped before step {step}'s update, {where}") from None
        except rewards.RewardStopped as stop:
            log.warning("%s and did not return within %g s: step %d is not finished", stop, rewards.STOP_GRACE_S, step)
            raise Preempted(stop.signame, self.state.global_step, find_checkpoint(Path(self.args.output_dir))) from None
        return per_func
