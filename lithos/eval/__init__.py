"""Scripted batch evaluation: accuracy and speed of a model on JSONL task files, and comparison of
two configurations (kernel paths, speculative decoding, sampling) on the same items.

    import lithos
    from lithos.eval import load_task, evaluate, compare

    model = lithos.load()
    task = load_task("gsm8k/test.jsonl", template="gsm8k-chat.json")
    run = evaluate(model, task, {"seed": 0}, batch_size=8, limit=100, out="eval-results")
    print(run.table(), run.accuracy)
    diff = compare(model, task, {"kernels": "reference"}, {"kernels": "fused"}, limit=100)
    print(diff.table())                       # greedy runs of equivalent paths must differ nowhere

Task files and templates: `lithos.eval.tasks`; scoring: `lithos.eval.scoring`; running, results
files and resuming: `lithos.eval.runner`; the command: `lithos eval` (`lithos.eval.cli`).
"""

from lithos.eval.runner import Comparison, Difference, EvalRun, RunConfig, compare, diff_runs, evaluate
from lithos.eval.scoring import Score, extract_choice, extract_number, score_choice, score_exact, score_math
from lithos.eval.tasks import Item, Task, Template, load_task

__all__ = [
    "Comparison",
    "Difference",
    "EvalRun",
    "Item",
    "RunConfig",
    "Score",
    "Task",
    "Template",
    "compare",
    "diff_runs",
    "evaluate",
    "extract_choice",
    "extract_number",
    "load_task",
    "score_choice",
    "score_exact",
    "score_math",
]
