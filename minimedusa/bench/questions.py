"""The questions the benchmark times: MT-Bench's first turns, or the project's held-out seed
prompts where MT-Bench is not at hand.

MT-Bench (Zheng et al. 2023: FastChat's question.jsonl, 80 questions in 8 categories) is other
authors' text and is not shipped: --questions FILE, or ../shared/data/ beside the repository.
A file that is not MT-Bench's JSON lines is refused in one line naming the line, before any
model loads.
"""
import json
import sys
from pathlib import Path

from minimedusa.errors import UserError
from minimedusa.training.seed_prompts import seed_prompts

MT_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / \
    "mt_bench_questions.jsonl"  # where MT-Bench is looked for when --questions is not given
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
              "humanities")  # MT-Bench's 8, which the seed prompts also have (and chitchat)


def first_turns(path: Path, per_category: int) -> list[dict]:
    """The first `per_category` questions of each MT-Bench category, first turn only."""
    if not path.is_file():
        raise UserError(f"MT-Bench questions not found at {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--questions {path}: cannot read it as text ({e})") from None
    taken, counts = [], {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        q = mt_bench_question(line, f"--questions {path} line {i}")
        if counts.get(q["category"], 0) < per_category:
            counts[q["category"]] = counts.get(q["category"], 0) + 1
            taken.append({"id": q.get("question_id", i), "category": q["category"],
                          "prompt": q["turns"][0]})
    if not taken:
        raise UserError(f"--questions {path} holds no question")
    return taken


def mt_bench_question(line: str, where: str) -> dict:
    """A line of FastChat's question.jsonl: {"question_id", "category", "turns": [text, ...]}."""
    try:
        q = json.loads(line)
    except ValueError:
        q = None
    if not (isinstance(q, dict) and isinstance(q.get("category"), str)
            and isinstance(q.get("turns"), list) and q["turns"]
            and all(isinstance(turn, str) and turn.strip() for turn in q["turns"])):
        raise UserError(f"{where}: not an MT-Bench question (a JSON object with a \"category\" "
                        "and \"turns\", a list of texts, as FastChat's question.jsonl)")
    return q


def held_out_seed_prompts(per_category: int) -> list[dict]:
    """The last `per_category` seed prompts of each of MT-Bench's categories, in its shape.

    Held out as format_quality.py's are: training answers the first seed prompts in seed 0's
    order (the shipped heads the first 6,144 of 6,617), so the last ones are prompts those heads
    never saw. Another seed would hold out little: every seed shuffles the same templates x topics.
    subtle: unseen, but of the templates' kind, on which heads guess better than on MT-Bench
    (self_distill.py: first guess accepted 56% against 24%), so tokens/step come out higher."""
    prompts = seed_prompts()
    taken = []
    for category in CATEGORIES:
        last_first = [i for i in reversed(range(len(prompts)))
                      if prompts[i]["category"] == category]
        taken += [{"id": f"seed-{i}", **prompts[i]} for i in last_first[:per_category]]
    return taken


def questions_to_time(given: Path | None, per_category: int) -> list[dict]:
    """MT-Bench's first turns, from --questions or the default place; without either, the
    project's held-out seed prompts. One line on stderr says which."""
    if given is None and not MT_BENCH.is_file():
        print(f"minimedusa: MT-Bench questions not found at {MT_BENCH}; timing the project's own "
              "held-out seed prompts, on which Medusa accepts more (give MT-Bench with "
              "--questions)", file=sys.stderr)
        return held_out_seed_prompts(per_category)
    questions = first_turns(given or MT_BENCH, per_category)  # given but missing: one-line error
    print(f"questions: MT-Bench first turns from {given or MT_BENCH}", file=sys.stderr)
    return questions
