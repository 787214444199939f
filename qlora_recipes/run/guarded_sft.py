"""objective=sft's trainer: TRL's SFTTrainer under the guards (run/guard.py)."""

from trl import SFTTrainer

from .guard import Guarded


class GuardedTrainer(Guarded, SFTTrainer):
    """SFT (objective=sft) under the guards."""
