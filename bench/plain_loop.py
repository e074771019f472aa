"""The plain loop the pipeline-ceiling benchmark (bench/ceiling.py) holds tokenmill against:
the same work per row as a `tokenmill run` with the stand-in engine, written the shortest
way, as a process of its own.

It reads the two used columns (`id`, `messages`) in 8,192-row batches with pyarrow, renders
each batch's chat template and tokenizes the batch with the model's fast tokenizer, answers
every row with `max_tokens` tokens (as the stand-in engine does), and writes each batch's
outputs (id, text, finish reason, prompt and output tokens) to one Parquet file and to
SQLite, one transaction per batch (WAL, `synchronous=NORMAL`, as tokenmill's SQLite).
Prints one JSON line: the rows, the tokens, and wall-clock stamps (`time.time()`) of its
steps, so the benchmark can tell start-up from the work on the rows.

    python -m bench.plain_loop INPUT.parquet OUT_FOLDER --tokenizer ~/.cache/tokenmill/models/smollm2-135m --max-tokens 4
"""

from __future__ import annotations

import time

T_MAIN = time.time()  # the interpreter is up; the imports below are the loop's start-up

import argparse  # noqa: E402
import json  # noqa: E402
import sqlite3  # noqa: E402
from pathlib import Path  # noqa: E402

BATCH_ROWS = 8192
COLUMNS = ["id", "messages"]


def run(inp: str, out: Path, tokenizer: str, max_tokens: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    t_imported = time.time()
    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    t_tokenizer = time.time()
    out.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(out / "outputs.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS outputs (id TEXT PRIMARY KEY, text TEXT, finish_reason TEXT, "
               "prompt_tokens INTEGER, output_tokens INTEGER)")
    schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("finish_reason", pa.string()),
                        ("prompt_tokens", pa.int32()), ("output_tokens", pa.int32())])
    answer = " ".join(["ok"] * max_tokens)
    rows = prompt_tokens = 0
    with pq.ParquetWriter(out / "outputs.parquet", schema) as writer:
        for batch in pq.ParquetFile(inp).iter_batches(batch_size=BATCH_ROWS, columns=COLUMNS):
            ids = batch.column("id").to_pylist()
            texts = tok.apply_chat_template(batch.column("messages").to_pylist(), tokenize=False,
                                            add_generation_prompt=True)
            counts = [len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]
            n = len(ids)
            cols = {"id": ids, "text": [answer] * n, "finish_reason": ["length"] * n, "prompt_tokens": counts,
                    "output_tokens": [max_tokens] * n}
            writer.write_table(pa.table(cols, schema=schema))
            db.execute("BEGIN")
            db.executemany("INSERT INTO outputs VALUES (?, ?, ?, ?, ?)", zip(*cols.values()))
            db.execute("COMMIT")
            rows += n
            prompt_tokens += sum(counts)
    db.close()
    return {"rows": rows, "prompt_tokens": prompt_tokens, "main_at": T_MAIN, "imported_at": t_imported,
            "tokenizer_at": t_tokenizer, "rows_done_at": time.time()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True, help="the model's local folder (its fast tokenizer and chat template)")
    ap.add_argument("--max-tokens", type=int, default=4)
    args = ap.parse_args(argv)
    print(json.dumps(run(args.input, Path(args.out), args.tokenizer, args.max_tokens)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
