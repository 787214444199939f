"""Where the files that ship with the library live: conf/, recipes/, launch/ and assets/.

In a source checkout (and an editable install) they are the repository's top-level folders; an
installed wheel carries copies of them inside the package, under `shipped/` (pyproject.toml maps
them there). Everything that reads one of these folders asks this module, so `qlora` works the same
from any directory.
"""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _root() -> Path:
    shipped = PACKAGE_DIR / "shipped"
    return shipped if (shipped / "conf").is_dir() else PACKAGE_DIR.parent


ROOT = _root()
CONF_DIR = ROOT / "conf"
RECIPES_DIR = ROOT / "recipes"


def shipped_path(rel: str = "") -> str:
    """`${shipped:assets/tiny-llama}` in a config: a path to a shipped file that works from any cwd."""
    return str(ROOT / rel)
