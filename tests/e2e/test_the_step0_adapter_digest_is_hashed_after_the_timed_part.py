"""metrics.json's adapter_sha256_step0 (the adapters a run started from; several ranks compare theirs
before training) is, in one process, hashed once the timed part is over, from the host copy of the
initial adapters that the OOM ladder keeps anyway: train_s holds no device->host copy and sha256 of
every adapter tensor, and the digest is still the one of the adapters as training found them."""

import hashlib
import sys

from qlora_recipes.model import loading
from qlora_recipes.run import lifecycle, metrics


def test_one_process_hashes_its_step0_adapters_after_train_s_and_records_the_initial_ones(smoke_run, monkeypatch):
    initial: dict = {}
    real_make_trainable = loading.make_trainable

    def make_trainable(*args, **kwargs):
        model = real_make_trainable(*args, **kwargs)
        initial["digest"] = metrics.trainable_digest(model)  # before any trainer exists
        return model

    monkeypatch.setattr(loading, "make_trainable", make_trainable)
    hashed_by: list[str] = []  # the modules that started a sha256 inside the timed part
    real_sha256, real_ladder = hashlib.sha256, lifecycle.train_with_oom_ladder

    def sha256(*args, **kwargs):
        hashed_by.append(sys._getframe(1).f_globals.get("__name__", "?"))
        return real_sha256(*args, **kwargs)

    def timed_part(*args, **kwargs):  # trainer construction and train(): what train_s measures
        with monkeypatch.context() as inside:
            inside.setattr(hashlib, "sha256", sha256)
            return real_ladder(*args, **kwargs)

    monkeypatch.setattr(lifecycle, "train_with_oom_ladder", timed_part)
    out, _ = smoke_run()
    assert not [m for m in hashed_by if m in ("qlora_recipes.run.dist", "qlora_recipes.run.metrics")], hashed_by
    assert out["adapter_sha256_step0"] == initial["digest"] != out["adapter_sha256"]
