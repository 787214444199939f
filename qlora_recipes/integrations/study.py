"""The Optuna study of a sweep, kept in the sweep dir so that an interrupted search resumes.

conf/hydra/sweeper/optuna_resumable.yaml (used by `+sweep=optuna`) stores the study in
`sqlite:///<sweep dir>/optuna.db` under `study_name`; the preset's sweep dir is named after the
study, so running the same command again opens the same study. `resume` prepares Hydra's Optuna
sweeper for that: the trials already finished (complete, pruned, or failed as told by the sweeper)
count towards `n_trials` and are not run again; a trial left running by the interruption is marked
failed with the system attribute `interrupted` and not counted, and its parameters are enqueued, so
the next trial runs them anew; new jobs are
numbered after every trial so far (job dir N is trial N, none overwritten). A study records the stack
it searches (`claim`: the sweep's command-line overrides and its search space); the same study name
under another stack is refused in one line, so no trial of one stack is counted, or reported as the
best, for another.

optuna 2.10 (the newest hydra-optuna-sweeper 1.3 allows) stamps its schema version through a
connection it never commits; under SQLAlchemy 2 (no implicit autocommit) the stamp is rolled back
and its open write transaction locks the sqlite file. `open_storage` gives the engine autocommit:
every statement commits on its own, which is all one sweeper process writing needs.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import UserError

log = logging.getLogger(__name__)
DB_NAME = "optuna.db"
STACK_ATTR = "qlora_stack"  # study user attribute: the overrides and search space it searches
INTERRUPTED = "interrupted"  # trial system attribute: left running by an interrupted sweep


def open_storage(url: str):
    """An optuna RDBStorage for `url` that works under SQLAlchemy 2; a sqlite file's folder is
    created first."""
    import optuna

    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.RDBStorage(url, engine_kwargs={"isolation_level": "AUTOCOMMIT"})


def counted(trial) -> bool:
    """A trial that counts towards n_trials: finished, and not cut off by an interruption."""
    from optuna.trial import TrialState

    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return trial.state == TrialState.FAIL and not trial.system_attrs.get(INTERRUPTED)


def resume_state(storage, study_name: str) -> tuple[int, int]:
    """(trials that count so far, trials in the study) for study_name in storage, after marking
    the trials an interruption left running; (0, 0) for a new study."""
    import optuna
    from optuna.trial import TrialState

    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:  # optuna 2.10: no study of that name yet
        return 0, 0
    trials = study.get_trials(deepcopy=False)
    for trial in trials:
        if trial.state in (TrialState.RUNNING, TrialState.WAITING):
            storage.set_trial_system_attr(trial._trial_id, INTERRUPTED, True)
            storage.set_trial_state(trial._trial_id, TrialState.FAIL)
            params = trial.params or trial.system_attrs.get("fixed_params")  # WAITING: enqueued, never run
            if params:  # first in line: study.ask takes an enqueued trial before it samples
                study.enqueue_trial(params)
            log.warning(
                "optuna: trial %d was cut off by an interruption; its parameters are run again first", trial.number
            )
    done = sum(counted(t) for t in optuna.load_study(study_name=study_name, storage=storage).trials)
    return done, len(trials)


def resume(sweeper) -> None:
    """Point Hydra's OptunaSweeperImpl (after setup) at the persistent study: its storage, the
    trials still to run, and the next job number."""
    if not isinstance(sweeper.storage, str) or not sweeper.study_name:
        return  # in memory, or no name to find the study again by: nothing to resume
    storage = open_storage(sweeper.storage)
    done, total = resume_state(storage, sweeper.study_name)
    sweeper.storage = storage
    if total:
        log.info(
            "optuna: study %r resumed from %s: %d of %d trials done, %d to run",
            sweeper.study_name,
            storage.url,
            done,
            sweeper.n_trials,
            max(sweeper.n_trials - done, 0),
        )
        # A seeded sampler starts its random stream again: without a new seed the resumed
        # search would propose the first trials' parameters once more. (A grid sampler is still
        # a partial here; it skips the grid points the study holds by itself.)
        if hasattr(sweeper.sampler, "reseed_rng"):
            sweeper.sampler.reseed_rng()
    sweeper.n_trials = max(sweeper.n_trials - done, 0)
    sweeper.job_idx = total  # job dir N is trial N


def searched_stack(sweeper, arguments: list[str]) -> dict:
    """What a study searches: the sweep's command-line overrides (the stack) and its search space."""
    params = sweeper.params or {}
    return {"overrides": sorted(map(str, arguments)), "search": {str(k): str(v) for k, v in sorted(params.items())}}


def claim(sweeper, arguments: list[str]) -> None:
    """The persistent study records the stack it searches on its first sweep; a later sweep under
    the same study name must search the same stack (one line naming both, and the way out)."""
    import optuna

    if not sweeper.study_name or isinstance(sweeper.storage, str):
        return  # in memory: a fresh study each sweep (resume() has not opened a storage)
    try:  # load first: optuna logs "Using an existing study" when create_study finds one
        study = optuna.load_study(study_name=sweeper.study_name, storage=sweeper.storage)
    except KeyError:  # optuna 2.10: no study of that name yet
        study = optuna.create_study(
            study_name=sweeper.study_name, storage=sweeper.storage, directions=sweeper._get_directions()
        )
    mine = searched_stack(sweeper, arguments)
    recorded = study.user_attrs.get(STACK_ATTR)
    if recorded is None:  # a new study, or one from before studies recorded their stack
        study.set_user_attr(STACK_ATTR, mine)
        return
    if recorded != mine:
        raise UserError(
            f"optuna study {sweeper.study_name!r} ({sweeper.storage.url}) searched another stack than this sweep "
            f"({_differences(recorded, mine)}); its trials do not answer this one: give this sweep its own study "
            "with hydra.sweeper.study_name=NAME, or run the study's own overrides again to resume it"
        )


def _differences(recorded: dict, mine: dict) -> str:
    """What this sweep changes against the study's stack: overrides it adds (+) or drops (-), the search."""
    was, now = set(recorded.get("overrides", [])), set(mine["overrides"])
    changes = [f"+{o}" for o in sorted(now - was)] + [f"-{o}" for o in sorted(was - now)]
    if recorded.get("search") != mine["search"]:
        changes.append(f"search space {mine['search']} instead of {recorded.get('search')}")
    return ", ".join(changes)
