"""The package as Python shows it: a docstring whose example runs, and dir() and help() that list the
public API (the lazy exports included before their first use), not the machinery behind it."""

from __future__ import annotations

import pydoc
import re
import shutil
import subprocess
import sys
import textwrap

import tpshard

PUBLIC = sorted([*tpshard.__all__, "__version__"])


def test_the_docstring_shows_the_library_in_ten_lines_and_its_example_runs(llama, tmp_path, monkeypatch):
    example = textwrap.dedent(tpshard.__doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0])
    assert len(example.splitlines()) <= 10
    shutil.copytree(llama, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(example, names)  # noqa: S102 - the docstring's own example, as a reader would paste it
    assert names["plan"].topology.world_size == 8 == len(list(tmp_path.glob("out/rank-*")))
    assert names["state_dict"].keys() == set(names["tensors"])


def test_dir_lists_the_public_api_before_first_use():
    out = subprocess.run([sys.executable, "-c", "import tpshard; print(' '.join(dir(tpshard)))"], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == PUBLIC


def test_help_documents_the_public_api_and_not_the_lazy_machinery():
    text = pydoc.render_doc(tpshard, renderer=pydoc.plaintext)
    documented = set(re.findall(r"^    class (\w+)\(", text, re.M)) | set(re.findall(r"^    (\w+)\(", text, re.M))
    assert documented == set(tpshard.__all__)
    assert "__getattr__" not in text and "_EXPORTS" not in text
    assert "Example:" in pydoc.render_doc(tpshard.open_rank, renderer=pydoc.plaintext)


def test_help_shows_the_public_classes_own_members_not_every_msgspec_struct_member():
    text = pydoc.render_doc(tpshard, renderer=pydoc.plaintext)
    for member in ("__rich_repr__", "__struct_config__", "__copy__", "__replace__", "inherited from msgspec"):
        assert member not in text
    assert "Data descriptors defined here" in text and "attn_dp" in text and "rank_shards" in text
    assert len(text.splitlines()) < 450  # it was 569 lines, 165 of them msgspec's members three times over
    for cls in (tpshard.Topology, tpshard.Options, tpshard.Plan):
        assert not [name for name in dir(cls) if name.startswith("_")]
        assert cls.__doc__ and cls.__doc__.strip()


def test_the_public_classes_behave_as_structs_with_their_shortened_dir():
    import copy
    import pickle

    import msgspec

    t = tpshard.Topology(tp=8, attn_dp=2)
    assert pickle.loads(pickle.dumps(t)) == t == copy.copy(t) and hash(t) == hash(copy.copy(t))
    assert msgspec.json.decode(msgspec.json.encode(t), type=tpshard.Topology) == t
    assert msgspec.structs.replace(tpshard.Options(), pad=False).pad is False
