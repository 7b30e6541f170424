"""The package surface: what `import attention_ext` makes reachable, and the developer-only CUDA
kernel selection (attention_ext.softmax.set_cuda_kernels)."""
import os
import subprocess
import sys

import pytest

import attention_ext as ae
from attention_ext.softmax import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, **env):
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **env})
    return res.returncode, res.stdout.strip(), res.stderr


def test_subpackages_reachable_after_bare_import():
    """nn and models are imported on first use, in a fresh interpreter (here they are imported
    already by other tests)."""
    rc, out, err = run_python("import sys, attention_ext as ae; before = 'attention_ext.nn' in sys.modules; "
                              "print(before, ae.nn.MultiheadAttention.__name__, ae.models.LanguageModel.__name__)")
    assert rc == 0, err
    assert out == "False MultiheadAttention LanguageModel"
    with pytest.raises(AttributeError):
        ae.no_such_module


def test_top_level_api():
    for name in ("attention", "attention_weights", "scaled_dot_product_attention", "flash_attn_func",
                 "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func", "dropout_mask",
                 "reference", "softmax", "nn", "models"):
        assert name in ae.__all__ and getattr(ae, name) is not None
    assert ae.attention is ae.softmax.attention and ae.reference.attention is ae.softmax.reference.attention


@pytest.fixture
def restore_kernels():
    old = ops.cuda_kernels()
    yield
    ops.set_cuda_kernels(**old)


def test_set_cuda_kernels(restore_kernels):
    assert ops.cuda_kernels() == dict(hopper_fwd=1, hopper_bwd=1, tune_fwd=0, tune_bwd=0, force_simt=False)
    old = ae.softmax.set_cuda_kernels(hopper_fwd=0, tune_bwd=3)
    assert ae.softmax.set_cuda_kernels(**old) == dict(hopper_fwd=0, hopper_bwd=1, tune_fwd=0, tune_bwd=3,
                                                      force_simt=False)
    assert ops.cuda_kernels() == old
    if ops.HAS_EXT:  # the op states the rules (without the extension nothing runs on CUDA)
        for bad, name in ((dict(hopper_fwd=3), "hopper_fwd"), (dict(hopper_bwd=3), "hopper_bwd"),
                          (dict(tune_fwd=-1), "tune_fwd")):
            with pytest.raises(ValueError, match=name):
                ae.softmax.set_cuda_kernels(**bad)
    assert ops.cuda_kernels() == old


def test_kernel_selection_ignores_the_environment():
    """The selection is an argument (set_cuda_kernels), never an environment variable: the one that
    existed before the wgmma kernels were measured is gone, and setting it changes nothing."""
    rc, out, err = run_python("import attention_ext as ae; print(sorted(ae.softmax.cuda_kernels().items()))",
                              ATTENTION_EXT_CUDA_KERNELS="hopper_fwd=0,tune_bwd=3")
    assert rc == 0, err
    assert out == str(sorted(dict(hopper_fwd=1, hopper_bwd=1, tune_fwd=0, tune_bwd=0, force_simt=False).items()))


def test_package_discovery_covers_every_subpackage():
    """A non-editable install ships only what pyproject's discovery finds: every directory under
    attention_ext/ with an __init__.py must be found (a hand-written list once left out linear,
    sparse and decode)."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11: the [test] extra installs tomli
        import tomli as tomllib
    from setuptools import find_packages

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools_cfg = tomllib.load(f)["tool"]["setuptools"]
    assert isinstance(setuptools_cfg["packages"], dict), "packages are discovered (packages.find), not listed"
    find = setuptools_cfg["packages"]["find"]
    found = set(find_packages(ROOT, include=find["include"], exclude=find.get("exclude", ())))
    on_disk = {os.path.relpath(d, ROOT).replace(os.sep, ".")
               for d, _, files in os.walk(os.path.join(ROOT, "attention_ext")) if "__init__.py" in files}
    assert {"attention_ext.linear", "attention_ext.sparse", "attention_ext.decode"} <= on_disk
    assert on_disk <= found, f"not packaged: {sorted(on_disk - found)}"
    assert all(p == "attention_ext" or p.startswith("attention_ext.") for p in found), found
    assert "py.typed" in setuptools_cfg["package-data"]["attention_ext"]


def test_build_without_torch_says_what_to_do():
    """setup.py compiles against the installed torch: without one it exits with one line, not a
    traceback (torch's imports blocked by a sys.meta_path finder)."""
    code = ("import runpy, sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "sys.argv = ['setup.py', '--version']\n"
            "runpy.run_path('setup.py', run_name='__main__')\n")
    rc, out, err = run_python(code)
    assert rc == 1, (out, err)
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    assert "torch must be installed before building" in err and "--no-build-isolation" in err, err
