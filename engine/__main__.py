"""Show a person real text: ``python -m engine "The capital of France is"``.

Streams the embedded model's greedy continuation to the terminal, token by
token, from a plain loop over ``Engine.step`` in this thread: the engine as a
library, with no server around it. (The server runs the same steps from its own
loop, ``streams``' hub, in a worker thread that hands the events to Trio.)
"""

from __future__ import annotations

import argparse
import sys
import uuid

from . import GenerationRequest, SamplingParams, TokenEvent, load_engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument(
        "--model", default="smollm2", help="smollm2, tiny-gpt2, tiny-llama or a folder"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    engine = load_engine(args.model, args.device)
    request = GenerationRequest(
        request_id=uuid.uuid4().hex,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(temperature=args.temperature, seed=args.seed),
    )
    engine.submit(request)
    sys.stdout.write(args.prompt)
    while engine.has_work():
        for event in engine.step():
            text = event.text if isinstance(event, TokenEvent) else "\n"
            sys.stdout.write(text)
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
