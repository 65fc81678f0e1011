"""Each kind of bad input gets a clear error naming the file, row, column or field."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.config import InputSpec
from batchgen.errors import InputError
from helpers import read_rows, write_prompts


def spec(path, **kw):
    return InputSpec(path=str(path), prompt_column="prompt", id_column="id", **kw)


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="nope.parquet.*not found"):
        read_rows(spec(tmp_path / "nope.parquet"))


def test_glob_and_directory_without_matches(tmp_path):
    with pytest.raises(InputError, match="matches no file"):
        read_rows(spec(tmp_path / "*.parquet"))
    with pytest.raises(InputError, match="holds no .parquet"):
        read_rows(spec(tmp_path))


def test_corrupt_parquet(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(InputError, match="bad.parquet: not a readable Parquet file"):
        read_rows(spec(bad))


def test_missing_column_lists_the_columns(tmp_path):
    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a"], "question": ["hi"]}), p)
    with pytest.raises(InputError, match=r"p.parquet: missing prompt column 'prompt'; columns are: id, question"):
        read_rows(spec(p))


def test_wrong_column_type(tmp_path):
    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a"], "prompt": [42]}), p)
    with pytest.raises(InputError, match="column 'prompt' has type int64, expected string"):
        read_rows(spec(p))
    q = tmp_path / "q.parquet"
    pq.write_table(pa.table({"id": ["a"], "prompt": ["x"], "mt": ["many"]}), q)
    with pytest.raises(InputError, match="column 'mt' \\(per-row max_tokens\\) has type string"):
        read_rows(spec(q, sampling_columns={"max_tokens": "mt"}))


def test_duplicate_ids_name_both_rows(tmp_path):
    a = write_prompts(tmp_path / "a.parquet", n=3)
    b = write_prompts(tmp_path / "b.parquet", n=2)
    with pytest.raises(InputError, match=r"b.parquet, row 0 \(id 'r0000'\): duplicate id 'r0000' \(first seen at "
                                         r".*a.parquet, row 0 \(id 'r0000'\)\)"):
        read_rows(spec(tmp_path / "*.parquet"))
    del a, b


def test_null_id(tmp_path):
    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a", None], "prompt": ["x", "y"]}), p)
    with pytest.raises(InputError, match="row 1: id column 'id' is null"):
        read_rows(spec(p))


def test_default_ids_come_from_shard_and_row(tmp_path):
    write_prompts(tmp_path / "s1.parquet", n=2)
    write_prompts(tmp_path / "s2.parquet", n=1)
    index, _ = read_rows(InputSpec(path=str(tmp_path), prompt_column="prompt"))
    assert index.ids.to_pylist() == ["s1:0", "s1:1", "s2:0"]


def test_messages_column_type_is_checked(tmp_path):
    p = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a"], "msgs": [["just a string"]]}), p)
    with pytest.raises(InputError, match="column 'msgs' has type list<.*string>, expected a list of"):
        read_rows(InputSpec(path=str(p), messages_column="msgs", id_column="id"))
