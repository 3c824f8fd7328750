"""planc.json as the contract's record (``planc.plan.checkpoint``): one writer, two readers (the runtime's
``--resume`` and ``planc checkpoint``), the same checks and the same one-line messages for both."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from planc.plan import checkpoint as M


def _folder(tmp_path):
    step = tmp_path / "run" / "step3"
    step.mkdir(parents=True)
    files = {}
    for name in (".metadata", "__0_0.distcp"):
        (step / name).write_bytes(f"bytes of {name}".encode())
        files[name] = M.file_entry(step / name)
    manifest = M.Manifest(plan="p", digest="ab" * 32, step=3, world_size=2, global_batch=16, micro_batch=8,
                          micro_batches=2, precision="fp32", zero=0, optimizer={"name": "sgd", "lr": 0.1},
                          parameters=({"name": "layers.0.weight", "shape": [4, 2], "dtype": "f32"},), files=files,
                          data={"drawn": 6}, rng={"0": "AAAA", "1": "BBBB"}, extra=(("later_key", [1]),))
    M.write(step, manifest)
    M.write_latest(tmp_path / "run", "step3")
    return step, manifest


def test_written_read_back_the_same_record(tmp_path):
    step, manifest = _folder(tmp_path)
    assert M.resolve(tmp_path / "run") == str(step)
    back = M.read(step)
    assert back == manifest and back.drawn == 6 and back.format == 2
    doc = json.loads((step / "planc.json").read_text())
    assert doc["bytes"] == sum(f.size for f in manifest.files.values()) and doc["later_key"] == [1]
    assert doc["files"][".metadata"]["sha256"] == hashlib.sha256(b"bytes of .metadata").hexdigest()
    assert (step / "planc.json").read_text() == manifest.dumps()          # deterministic: sorted keys
    assert (tmp_path / "run" / "latest").read_text() == "step3\n"
    M.verify_files(step, back.files)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format=1), "planc.json is not a planc checkpoint of format 2 (format 1); this planc reads "
                                   "format 2 only"),
    (lambda d: d.pop("files"), "planc.json: key 'files' is missing"),
    (lambda d: d.update(step="3"), 'planc.json: step: expected an integer, got "3"'),
    (lambda d: d.update(zero=True), "planc.json: zero: expected an integer, got true"),
    (lambda d: d.update(data={"drawn": -1}), "planc.json: data.drawn: expected a non-negative integer, got -1"),
    (lambda d: d["parameters"].append(dict(d["parameters"][0])), "planc.json: parameters: 'layers.0.weight' is "
                                                                  "listed twice"),
    (lambda d: d["files"].update({"../x": {"size": 1, "sha256": "00"}}), "planc.json: files: '../x' is not a file "
                                                                         "name inside the folder"),
])
def test_a_bad_manifest_is_one_line_naming_the_key(tmp_path, edit, message):
    step, manifest = _folder(tmp_path)
    doc = manifest.to_json()
    edit(doc)
    with pytest.raises(M.ManifestError, match=f"^{re.escape(message)}$"):
        M.Manifest.from_json(doc)


def test_the_files_must_be_the_ones_listed(tmp_path):
    step, manifest = _folder(tmp_path)
    (step / "__0_0.distcp").write_bytes(b"bytes of __0_0.distcX")                  # same size, other bytes
    with pytest.raises(M.ManifestError, match=r"^__0_0\.distcp's sha256 is [0-9a-f]{16}\.\.\., planc\.json lists "
                                              r"[0-9a-f]{16}\.\.\. \(the file was changed or damaged\)$"):
        M.verify_files(step, manifest.files)
    (step / "__0_0.distcp").write_bytes(b"cut")
    with pytest.raises(M.ManifestError, match=re.escape("__0_0.distcp has 3 bytes, planc.json lists 21 (cut or changed)")):
        M.verify_files(step, manifest.files)
    (step / "__0_0.distcp").unlink()
    with pytest.raises(M.ManifestError, match=re.escape("__0_0.distcp is missing (planc.json lists it with 21 bytes)")):
        M.verify_files(step, manifest.files)
    (step / "__5_0.distcp").write_bytes(b"")
    with pytest.raises(M.ManifestError, match=re.escape("__5_0.distcp is not listed in planc.json's files (not part "
                                                        "of this checkpoint)")):
        M.verify_files(step, manifest.files)


def test_resolve_says_what_is_missing(tmp_path):
    with pytest.raises(M.ManifestError, match="^no such checkpoint folder$"):
        M.resolve(tmp_path / "nowhere")
    (tmp_path / "cut" / ".step2.partial").mkdir(parents=True)
    with pytest.raises(M.ManifestError, match=re.escape("only an incomplete checkpoint is there (.step2.partial: a "
                                                        "save that did not finish, never loaded); no latest file")):
        M.resolve(tmp_path / "cut")
    with pytest.raises(M.ManifestError, match=re.escape("not a checkpoint: no planc.json (it is written last: an "
                                                        "incomplete checkpoint is never loaded) and no latest file "
                                                        "naming one")):
        M.resolve(tmp_path / "cut" / ".step2.partial")
    (tmp_path / "cut" / "latest").write_text("../elsewhere\n")
    with pytest.raises(M.ManifestError, match=re.escape("latest names '../elsewhere', which is not a complete "
                                                        "checkpoint")):
        M.resolve(tmp_path / "cut")


def test_both_readers_use_the_contract():
    from planc.checkpoint import read as checkpoint_read
    from planc.runtime import checkpoint
    assert checkpoint.Manifest is checkpoint_read.Manifest is M.Manifest
    assert checkpoint.FORMAT == checkpoint_read.FORMAT == M.FORMAT == 2
    assert checkpoint.MANIFEST == checkpoint_read.PLANC_JSON == "planc.json"
