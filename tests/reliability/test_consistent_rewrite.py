"""Issue 32, Integrity: an edit of a published dataset that rewrites its manifest consistently is found.

The campaign's case: a Parquet part edited, and the manifest's sizes, row counts and hashes rewritten to match,
passed `cse verify` while the Arrow copy (which training reads) still held the old values. Now every manifest in a
data root is sealed (storage/seal.py) and the full check compares the Arrow copy with the parts. New cases of the
class: a forger who also rebuilds the Arrow copy and its entries; a manifest from before seals (unsealed), where the
comparison of the two views finds the edit; a data root whose seal key went missing."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from cse.ops.cli import main as cse
from cse.storage.manifest import MANIFEST_NAME, file_facts
from cse.storage.seal import SEAL_KEY_FILE
from tests.reliability.conftest import data_runs, ingest, part


def _edit_part_and_rewrite_the_manifest(root, key: str, *, keep_seal: bool = True) -> dict:
    """Change one sentence of part 0 of nli/<key> and rewrite the manifest's sizes, rows and hashes to match."""
    folder = root.dataset_dir("nli", key)
    target = part(root, "nli", key)
    table = pq.read_table(target)
    sent0 = table.column("sent0").to_pylist()
    sent0[0] = "an edited sentence ."
    target.chmod(0o644)
    pq.write_table(table.set_column(table.schema.get_field_index("sent0"), "sent0", pa.array(sent0)), target)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest.update(file_facts(folder, manifest["files"]))
    if not keep_seal:
        manifest.pop("seal")
    (folder / MANIFEST_NAME).chmod(0o644)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def test_a_consistent_rewrite_of_a_part_and_its_manifest_is_found(ingest_config, root, capsys):
    nli = ingest("nli", ingest_config)
    _edit_part_and_rewrite_the_manifest(root, nli.key)
    assert cse(["verify", "--quick"]) == 1  # the seal is checked by the cheap check too
    out = capsys.readouterr().out
    assert f"DAMAGED nli/{nli.key}" in out and "the manifest's seal does not match its content" in out

    again = ingest("nli", ingest_config)  # the cache hit finds it, quarantines it, rebuilds it
    assert again.key == nli.key and not again.cache_hit
    [run] = data_runs("ingest-nli")[-1:]
    assert "seal does not match" in run.data.tags["quarantine_reason"]
    assert pq.read_table(part(root, "nli", nli.key)).column("sent0")[0].as_py() != "an edited sentence ."
    assert cse(["verify"]) == 0


def test_rebuilding_the_arrow_copy_too_is_found(ingest_config, root, capsys):
    """A forger who also rewrites the Arrow copy from the edited part and records it, without the seal key."""
    from cse.storage.arrow_copy import ARROW_DIR, _write_copy
    from cse.storage.atomic import remove_path

    nli = ingest("nli", ingest_config)
    manifest = _edit_part_and_rewrite_the_manifest(root, nli.key)
    folder = root.dataset_dir("nli", nli.key)
    remove_path(folder / ARROW_DIR)
    new = folder / ".forged"
    copy = _write_copy(folder, manifest["files"], new, kind="nli", key=nli.key, content_hash=manifest["content_hash"])
    new.rename(folder / ARROW_DIR)
    manifest["arrow"] = copy.model_dump()
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    assert cse(["verify"]) == 1 and "seal does not match" in capsys.readouterr().out


def test_an_unsealed_manifest_is_still_caught_by_comparing_the_arrow_copy(ingest_config, root, capsys):
    """A manifest written before seals existed: the full check reads both views of the data and compares them."""
    nli = ingest("nli", ingest_config)
    _edit_part_and_rewrite_the_manifest(root, nli.key, keep_seal=False)
    assert cse(["verify", "--quick"]) == 0  # sizes, rows and the (rewritten) hashes all agree
    capsys.readouterr()
    assert cse(["verify"]) == 1
    out = capsys.readouterr().out
    assert "the values of sent0 of hf/part-00000.arrow differ from part-00000.parquet" in out


def test_a_missing_seal_key_is_named(ingest_config, root, capsys):
    nli = ingest("nli", ingest_config)
    (root.root / SEAL_KEY_FILE).unlink()
    assert cse(["verify", "--quick"]) == 1
    assert f"seal key {root.root / SEAL_KEY_FILE} is missing" in capsys.readouterr().out
    assert nli.rows > 0
