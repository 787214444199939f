"""A Ctrl-C never lands inside an import or a finalizer (qlora_recipes/interrupts.py): while the
command holds nothing it ends the process at once with the entry point's line; once it holds
something it waits until the import has finished, or the finalizer has returned, and is then a
KeyboardInterrupt as usual.
Each case runs in a child Python, with and without our handler: without it the import is left half
done (numpy failed that way once) or the Ctrl-C is lost."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO

INTERRUPTED_IN_AN_IMPORT = """
    import signal, time
    signal.raise_signal(signal.SIGINT)  # Ctrl-C in the middle of this module's import
    time.sleep(0.2)
    import json  # the import goes on importing
    DONE = True
"""
CHILD = """
    import sys, time
    if {ours}:
        from qlora_recipes import interrupts
        interrupts.install()
    class Finalized:
        def __del__(self):
            import signal
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while a finalizer runs
    try:
        {action}
        time.sleep(5)
        print("not interrupted")
    except KeyboardInterrupt:
        module = sys.modules.get("slow_module")
        print("interrupted" + (", slow_module imported in full" if getattr(module, "DONE", False) else ""))
"""
IMPORT = "import slow_module"
FINALIZER = "x = Finalized(); del x"


def _as_in_a_terminal() -> None:
    """A suite started in the background passes SIGINT on as ignored; a terminal's child gets it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run_python(code: str, cwd) -> subprocess.CompletedProcess:
    """A child Python running `code`, Ctrl-C as in a terminal; it imports this checkout's package,
    wherever `cwd` is."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_as_in_a_terminal,
    )


def _python(code: str, cwd) -> str:
    """What a child Python running `code` prints (its stderr too, after it, for the failure message)."""
    done = _run_python(code, cwd)
    return done.stdout.strip() + ("\n" + done.stderr if done.stderr else "")


def _child(tmp_path, action: str, ours: bool) -> str:
    (tmp_path / "slow_module.py").write_text(textwrap.dedent(INTERRUPTED_IN_AN_IMPORT))
    return _python(textwrap.dedent(CHILD).format(ours=ours, action=action), tmp_path).splitlines()[0]


@pytest.mark.parametrize("ours", [False, True], ids=["python's-handler", "ours"])
def test_ctrl_c_inside_an_import_waits_for_the_import_to_finish(tmp_path, ours):
    expected = "interrupted, slow_module imported in full" if ours else "interrupted"  # Python's: left half done
    assert _child(tmp_path, IMPORT, ours) == expected


@pytest.mark.parametrize("ours", [False, True], ids=["python's-handler", "ours"])
def test_ctrl_c_inside_a_finalizer_is_delivered_after_it(tmp_path, ours):
    expected = "interrupted" if ours else "not interrupted"  # Python's own: printed as ignored, then lost
    assert _child(tmp_path, FINALIZER, ours) == expected


def test_a_handler_installed_before_is_kept():
    code = (
        "import signal; from qlora_recipes import interrupts\n"
        "mine = lambda s, f: None; signal.signal(signal.SIGINT, mine); interrupts.install()\n"
        "print(signal.getsignal(signal.SIGINT) is mine)"
    )
    assert _python(code, REPO) == "True"


def test_a_second_ctrl_c_while_the_first_waits_is_not_held(tmp_path):
    (tmp_path / "stuck_module.py").write_text(
        "import os, signal, time\n"
        "signal.raise_signal(signal.SIGINT)  # held: the import is under way\n"
        "time.sleep(0.5)\n"
        "signal.raise_signal(signal.SIGINT)  # the user insists\n"
        "time.sleep(30)  # an import that would hang\n"
    )
    code = (
        "import time; from qlora_recipes import interrupts\n"
        "interrupts.install(); started = time.time()\n"
        "try:\n    import stuck_module\nexcept KeyboardInterrupt:\n    print(f'interrupted after {time.time() - started:.0f} s')"
    )
    said = _python(code, tmp_path)
    waited = re.match(r"interrupted after (\d+) s", said)
    assert waited and int(waited.group(1)) < 25, said  # not the 30 s the import would hang


def test_sigterm_is_raised_as_ctrl_c_is_and_names_itself(tmp_path):
    """SIGTERM (a preemption, a scheduler's kill) used to end the process at once, mid-write, with no
    line: with our handler it waits for the import under way, then raises as Ctrl-C does, named."""
    (tmp_path / "slow_module.py").write_text(textwrap.dedent(INTERRUPTED_IN_AN_IMPORT).replace("SIGINT", "SIGTERM"))
    code = (
        "import sys, time; from qlora_recipes import interrupts\n"
        "interrupts.install()\n"
        "try:\n    import slow_module\n    time.sleep(5)\n"
        "except KeyboardInterrupt as err:\n"
        "    print(interrupts.signal_name(err), interrupts.exit_code(interrupts.signal_name(err)),"
        " getattr(sys.modules.get('slow_module'), 'DONE', False))"
    )
    assert _python(code, tmp_path).splitlines()[0] == "SIGTERM 143 True"


HANGING_IMPORT = "import signal, time\nsignal.raise_signal({sig})\ntime.sleep(30)  # start-up's long import\n"


@pytest.mark.parametrize("sig, code", [("signal.SIGINT", 130), ("signal.SIGTERM", 143)])
def test_a_stop_signal_before_anything_is_held_ends_the_process_at_once_with_its_line(tmp_path, sig, code):
    (tmp_path / "long_import.py").write_text(HANGING_IMPORT.format(sig=sig))
    script = (
        "import time; from qlora_recipes import interrupts\n"
        "interrupts.install(lambda s: 'mine: ' + interrupts.starting_line(s))\n"
        "print('stdout before', end='')\n"
        "import long_import\n"
        "print('not stopped')"
    )
    started = time.monotonic()
    done = _run_python(script, tmp_path)
    name = sig.split(".")[1]
    said = "SIGINT (Ctrl-C)" if name == "SIGINT" else name
    assert (done.returncode, done.stderr) == (code, f"mine: stopped by {said} while starting; nothing was written\n")
    assert done.stdout == "stdout before"  # what was printed before is not lost with the exit
    assert time.monotonic() - started < 20  # not the import's 30 s


def test_once_something_is_held_a_stop_signal_waits_for_the_import_again(tmp_path):
    (tmp_path / "slow_module.py").write_text(textwrap.dedent(INTERRUPTED_IN_AN_IMPORT))
    code = (
        "import sys, time; from qlora_recipes import interrupts\n"
        "interrupts.install(interrupts.starting_line)\n"
        "with interrupts.raising():  # a run under way: its lock and files need letting go\n"
        "    try:\n        import slow_module\n        time.sleep(5)\n        print('not interrupted')\n"
        "    except KeyboardInterrupt:\n        print('interrupted', getattr(sys.modules.get('slow_module'), 'DONE', False))"
    )
    assert _python(code, tmp_path) == "interrupted True"
