"""The package itself: `import ductile` without torch (and without importing
matplotlib), the README one-liner, `python -m ductile` running the CLI,
mypy checking a user's calls against the package's annotations (py.typed),
and `cmake --install` giving an importable package that finds its plugins
from the install prefix. (The wheel, `pip wheel .` + `auditwheel repair`: test_wheel.py.)"""

import os
import subprocess
import sys

from conftest import SOURCE

BUILD = os.environ["DUCTILE_BINARY_DIR"]
CMAKE = os.environ["CMAKE_COMMAND"]


def python(code, env=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


def test_import_without_torch_and_without_matplotlib():
    proc = python(
        "import sys\n"
        "sys.modules['torch'] = None  # any 'import torch' fails\n"
        "import ductile\n"
        "plan = ductile.batching.pack([3, 1, 4, 1, 5], max_tokens=6)\n"
        "assert plan.step_count > 0\n"
        "assert 'matplotlib' not in sys.modules\n"
        "try:\n"
        "    import ductile.torch\n"
        "except ImportError:\n"
        "    print('no torch: ok')\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "no torch: ok"


def test_readme_one_liner():
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    proc = subprocess.run([sys.executable, "-c", "import ductile; print(ductile.plugins())"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=SOURCE)
    assert proc.returncode == 0, proc.stderr
    assert "'greedy'" in proc.stdout and "'v0.1'" in proc.stdout


def test_python_m_ductile_is_the_cli():
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    ours = subprocess.run([sys.executable, "-m", "ductile", "plugins", "list"],
                          capture_output=True, text=True, timeout=120, env=env)
    cli = subprocess.run([os.path.join(BUILD, "bin", "ductile"), "plugins", "list"],
                         capture_output=True, text=True, timeout=120)
    assert (ours.returncode, ours.stdout) == (0, cli.stdout)
    bad = subprocess.run([sys.executable, "-m", "ductile", "elastic", "--world-size", "x"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--world-size" in bad.stderr


def test_mypy_checks_calls_against_the_package_annotations(tmp_path):
    # Without py.typed mypy skips an installed package (its names are Any),
    # and the names `ductile` re-exports on first use are seen only through
    # the imports for type checkers in its __init__. numpy is not analysed
    # (most of a cold run's time); its names are Any here.
    (tmp_path / "mypy.ini").write_text("[mypy]\n[mypy-numpy,numpy.*]\nfollow_imports = skip\n")
    (tmp_path / "user.py").write_text(
        "import ductile\n"
        "import ductile.metrics\n"
        "config: ductile.Config = ductile.load_config('job.toml')\n"
        "ductile.load_config(42)\n"
        "prefix: int = ductile.metrics.seqlen_prefix('metrics')\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini",
                           "--cache-dir", str(tmp_path / "cache"), "--no-error-summary",
                           "user.py"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    errors = [line for line in proc.stdout.splitlines() if ": error: " in line]
    assert proc.returncode == 1 and len(errors) == 2, proc.stdout + proc.stderr
    assert errors[0].startswith("user.py:4:") and 'incompatible type "int"' in errors[0]
    assert '"load_config"' in errors[0] and "Config" in errors[0]
    assert errors[1].startswith("user.py:5:")
    assert 'expression has type "str", variable has type "int"' in errors[1]


def test_cmake_install_gives_an_importable_package(tmp_path):
    prefix = tmp_path / "prefix"
    proc = subprocess.run([CMAKE, "--install", BUILD, "--prefix", str(prefix)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = prefix / "lib" / "python3" / "dist-packages"
    assert (site / "ductile" / "torch" / "__init__.py").exists()
    assert (site / "ductile" / "py.typed").exists()
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run(
        [sys.executable, "-c",
         "import ductile\n"
         "print(ductile.__file__)\n"
         "for p in ductile.plugins('elasticity'): print(p['file'])\n"
         "from ductile.elasticity import compute_elastic_config\n"
         "print(compute_elastic_config({'elasticity': {'enabled': True,"
         " 'max_train_batch_size': 2000, 'micro_batch_sizes': [2, 4, 6], 'version': 0.1}},"
         " '0.9.0')[0])\n"],
        capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    assert lines[0].startswith(str(site))
    assert all(line.startswith(str(prefix / "lib" / "ductile" / "plugins")) for line in lines[1:-1])
    assert lines[-1] == "1680"
