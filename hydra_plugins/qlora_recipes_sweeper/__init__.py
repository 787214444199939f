"""Hydra's Optuna sweeper with a study that resumes (qlora_recipes/study.py). Hydra instantiates
sweepers only from the `hydra_plugins` namespace, hence this module; the logic lives in the package."""

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper


class ResumableOptunaSweeper(OptunaSweeper):
    """`storage` (a URL) and `study_name` name a study that outlives the sweep: the trials it holds
    count towards `n_trials`, and new jobs are numbered after them."""

    def sweep(self, arguments: list[str]) -> None:
        from qlora_recipes.integrations import study

        study.resume(self.sweeper)
        study.claim(self.sweeper, arguments)  # one study, one stack: another stack is refused
        return self.sweeper.sweep(arguments)
