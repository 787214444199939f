"""The data and base fingerprints each checkpoint records are hashed on a thread started once the data
is read, while the model loads: the guarded trainer's own call, at the start of the timed part, finds
them done instead of reading all of a large data file a second time inside train_s."""

import hashlib
import threading

from conftest import compose_cfg

from qlora_recipes.run import resume


def _count_sha256(monkeypatch) -> list[str]:
    """The names of the threads that start a sha256 in resume.py."""
    threads: list[str] = []
    real = hashlib.sha256

    def counted(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(resume.hashlib, "sha256", counted)
    return threads


def _stack(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"text": "row {i} " }}\n' for i in range(5000)))
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}')
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 8192)
    return compose_cfg(f"data.path={data}", f"model.name_or_path={base}")


def test_prefetched_fingerprints_are_not_hashed_again_when_the_trainer_asks(tmp_path, monkeypatch):
    cfg = _stack(tmp_path)
    monkeypatch.setattr(resume, "_FINGERPRINTS", {})
    threads = _count_sha256(monkeypatch)
    resume.prefetch_fingerprints(cfg).join()
    data, base = resume.data_fingerprint(cfg.data), resume.base_fingerprint(cfg.model)
    assert threads == ["fingerprints", "fingerprints"], "hashed again on the caller's thread"

    monkeypatch.setattr(resume, "_FINGERPRINTS", {})  # computed afresh on this thread: the same figures
    assert resume.data_fingerprint(cfg.data) == data and data["kind"] == "content"
    assert resume.base_fingerprint(cfg.model) == base and base["kind"] == "sampled"


def test_a_caller_waits_for_a_fingerprint_being_computed_instead_of_hashing_beside_it(tmp_path, monkeypatch):
    cfg = _stack(tmp_path)
    monkeypatch.setattr(resume, "_FINGERPRINTS", {})
    threads = _count_sha256(monkeypatch)
    with resume._COMPUTING:  # the prefetch thread is held where it would hash
        thread = resume.prefetch_fingerprints(cfg)
        waiting = threading.Thread(target=resume.data_fingerprint, args=(cfg.data,), name="trainer")
        waiting.start()
    thread.join()
    waiting.join()
    assert len(threads) == 2, f"data and base hashed once each, not {threads}"  # whichever thread got there first
