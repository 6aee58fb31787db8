"""`make docs` builds without a warning (warnings are errors), every public
class and function of the package has a docstring naming each of its
arguments and an entry on the API page, and the guide pages carry the
README sections they include."""

import enum
import inspect
import re
import subprocess
import sys

import pytest

import mpidp
from mpi_jobs import ROOT

pytestmark = pytest.mark.serial

PUBLIC = [n for n in mpidp.__all__
          if inspect.isclass(getattr(mpidp, n)) or inspect.isfunction(getattr(mpidp, n))]


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    out = tmp_path_factory.mktemp("html")
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                        str(ROOT / "docs"), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_every_public_name_has_a_docstring():
    missing = [n for n in PUBLIC if not (getattr(mpidp, n).__doc__ or "").strip()]
    algorithms = [n for n in mpidp.algorithms.__all__
                  if not (getattr(mpidp.algorithms, n).__doc__ or "").strip()]
    assert not missing and not algorithms, (missing, algorithms)


def public_objects():
    yield from ((n, getattr(mpidp, n)) for n in PUBLIC)
    yield from ((f"algorithms.{n}", getattr(mpidp.algorithms, n)) for n in mpidp.algorithms.__all__)


def test_every_argument_of_a_public_name_is_described_in_its_docstring():
    undescribed = {}
    for name, obj in public_objects():
        if inspect.isclass(obj) and issubclass(obj, enum.Enum):
            continue                                   # members, not arguments
        target = obj.__init__ if inspect.isclass(obj) else obj
        doc = (inspect.getdoc(obj) or "") + "\n" + (inspect.getdoc(target) or "")
        params = [p for p in inspect.signature(target).parameters if p not in ("self", "args",
                                                                            "kwargs")]
        missing = [p for p in params if not re.search(rf"\b{re.escape(p)}\b", doc)]
        if missing:
            undescribed[name] = missing
    assert not undescribed, undescribed


def test_the_api_page_documents_every_public_name(html):
    api = (html / "api.html").read_text()
    undocumented = [n for n in PUBLIC if f'id="mpidp.{n}"' not in api]
    undocumented += [n for n in mpidp.algorithms.__all__
                     if f'id="mpidp.algorithms.{n}"' not in api]
    assert not undocumented, undocumented


def test_guide_pages_include_their_readme_sections(html):
    assert "Coming from Heat" in (html / "coming-from.html").read_text()
    assert "MPIDP_TIMEOUT" in (html / "settings.html").read_text()
    assert "with_bagua" in (html / "algorithms.html").read_text()
