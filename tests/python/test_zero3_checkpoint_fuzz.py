"""A fuzz target over the readers of `latest` and the manifest of a zero3
checkpoint. They are Python, so the fuzzer is Hypothesis (not libFuzzer,
whose targets here are the C++ readers: tests/fuzz/): arbitrary bytes as
`latest`, as the manifest and as its checksum file, and valid manifests with
one entry replaced by an arbitrary JSON value (signed again, as a forger
would), loaded into a real engine. The only outcomes allowed are a load, a
value, or a ductile.Error with a message; and a failed load leaves the
engine as it was. Derandomized with a fixed number of examples: ctest runs
the same inputs every time (raise the examples with
DUCTILE_FUZZ_EXAMPLES=N to search longer)."""

import hashlib
import json
import os
import shutil
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ductile
from ductile.torch.zero3 import _checkpoint, _checkpoint_files

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_checkpoint_support import engine_of, same, saved_checkpoint, snapshot  # noqa: E402

EXAMPLES = int(os.environ.get("DUCTILE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)


def pointer_bytes():
    """Bytes as `latest` may hold them: mostly near the format, some not."""
    name = st.text(max_size=12)
    checksum = st.text(alphabet="0123456789abcdef", min_size=60, max_size=66)
    near = st.builds(lambda n, c, line: (f"{n}\n" + (f"sha256 {c}\n" if line else "")).encode(
        "utf-8", "surrogatepass"), name, checksum, st.booleans())
    return near | st.binary(max_size=200)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_checkpoint(tmp_path_factory.mktemp("fuzz"), 1, {"step": 1})[0]


@FUZZ
@given(data=pointer_bytes())
def test_latest_reader_takes_any_bytes(tmp_path, data):
    (tmp_path / "latest").write_bytes(data)
    base = os.path.realpath(tmp_path)
    try:
        pointer = _checkpoint_files.read_latest(str(tmp_path), base)
    except ductile.Error as e:
        assert str(e).startswith(str(tmp_path / "latest") + ": "), e
        return
    assert pointer is None or (isinstance(pointer.name, str) and pointer.name
                               and "/" not in pointer.name)


@FUZZ
@given(data=st.binary(max_size=400) | JSON.map(lambda v: json.dumps(v).encode()),
       signed=st.booleans(), sidecar=st.none() | st.binary(max_size=120))
def test_manifest_reader_takes_any_bytes(tmp_path, data, signed, sidecar):
    folder = tmp_path / "tag"
    folder.mkdir(exist_ok=True)
    (folder / "manifest.json").write_bytes(data)
    checksum = folder / "manifest.json.sha256"
    if sidecar is not None:
        checksum.write_bytes(sidecar)
    elif checksum.exists():
        os.unlink(checksum)
    digest = hashlib.sha256(data).hexdigest() if signed else "0" * 64
    pointer = _checkpoint_files.Pointer(str(tmp_path / "latest"), "tag", digest)
    source = _checkpoint_files.Source(str(folder), os.path.realpath(tmp_path), pointer)
    try:
        path, manifest = _checkpoint_files.read_manifest(source)
    except ductile.Error as e:
        assert str(e), e
        return
    assert signed and isinstance(manifest, dict) and path.endswith("manifest.json")


def entries(value, at=()):
    """Every (path, value) in a JSON value, the value itself first."""
    yield at, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from entries(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from entries(v, at + (i,))


@pytest.fixture(scope="module")
def forger(saved):
    """A valid manifest, its entries, and a fresh engine to load into."""
    text = (saved / "step1" / "manifest.json").read_text()
    manifest = json.loads(text)
    return manifest, [p for p, _ in entries(manifest) if p], engine_of(seed=1)


@FUZZ
@given(data=st.data())
def test_a_forged_manifest_loads_or_raises_a_ductile_error(saved, forger, tmp_path, data):
    manifest, paths, engine = forger
    forged = json.loads(json.dumps(manifest))
    at = data.draw(st.sampled_from(paths), label="entry")
    value = data.draw(JSON, label="value")
    target = forged
    for key in at[:-1]:
        target = target[key]
    target[at[-1]] = value
    root = tmp_path / "ckpt"
    if not root.exists():
        os.makedirs(root / "step1")
        for name in os.listdir(saved / "step1"):
            if name.endswith(".bin"):  # a file of its own: a link would lead out of it
                shutil.copy(saved / "step1" / name, root / "step1" / name)
    text = json.dumps(forged, indent=1).encode()
    (root / "step1" / "manifest.json").write_bytes(text)
    digest = hashlib.sha256(text).hexdigest()
    (root / "step1" / "manifest.json.sha256").write_text(f"{digest}  manifest.json\n")
    (root / "latest").write_text(f"step1\nsha256 {digest}\n")
    before = snapshot(engine)
    try:
        engine.load(root)
    except ductile.Error as e:
        assert str(e), e
        assert same(snapshot(engine), before)
    else:
        _checkpoint.load(engine, saved)  # back to the saved state for the next example
