"""`lithos generate` flags for speculative decoding, and the library options they become.

lithos generate "..." --spec ngram --draft-tokens 5
lithos generate "..." --spec self --draft-layers 8
lithos generate "..." --draft-model PATH           (implies --spec draft)
lithos generate "..." --draft-head PATH            (implies --spec head)
"""

from __future__ import annotations

import argparse
from typing import Any

from lithos.spec.engine import DEFAULT_DRAFT_TOKENS, SPEC_KINDS


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (same output, fewer target passes)")
    g.add_argument("--spec", choices=SPEC_KINDS, help="drafter: ngram (prompt lookup), self (early exit), draft, head")
    g.add_argument(
        "--draft-tokens", type=int, default=None, help=f"drafts per round, k (default {DEFAULT_DRAFT_TOKENS})"
    )
    g.add_argument("--draft-layers", type=int, help="target layers that draft for --spec self, e.g. 8")
    g.add_argument("--draft-model", help="smaller checkpoint with the same tokenizer (implies --spec draft)")
    g.add_argument("--draft-head", help="EAGLE-3 or MTP head directory (implies --spec head; lithos/spec/README.md)")


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The `generate` keywords the flags ask for (none when no speculative flag was given)."""
    given = {
        "spec": args.spec,
        "draft_tokens": args.draft_tokens,
        "draft_layers": args.draft_layers,
        "draft_model": args.draft_model,
        "draft_head": args.draft_head,
    }
    return {name: value for name, value in given.items() if value is not None}
