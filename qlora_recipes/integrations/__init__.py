"""The world around a run: experiment trackers, the Hugging Face Hub and model cards, sweep summaries
and Optuna studies, clusters (SLURM preemption, requeue, rendezvous)."""
