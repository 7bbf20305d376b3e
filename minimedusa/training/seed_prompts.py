"""Seed prompts for self-distillation (paper section 5), made offline from templates x topics.

The default model's training data is not available, and MT-Bench is for evaluation only, so the
prompts the model answers for its own heads' training data are written here: for each kind of
request people make (writing, roleplay, reasoning, math, coding, extraction, science,
humanities, chit-chat) a few request templates crossed with topics, plus arithmetic word
problems with random numbers. Deterministic for a seed, deduplicated, shuffled.

    python -m minimedusa.training.seed_prompts --out data/seed_prompts.jsonl
    # one {"category", "prompt"} per line
"""
import argparse
import json
import random
from pathlib import Path

from minimedusa.cli.flags import seed_int
from minimedusa.files.outputs import write_atomically

TOPICS = {
    "writing": [
        "a lighthouse keeper", "the first day of spring", "a city at night", "an old library",
        "a long train journey", "a lost letter", "the ocean", "a small bakery", "moving abroad",
        "a mountain village", "a rainy afternoon", "a childhood friend", "a forgotten garden",
        "the last day of school", "a street market", "an unexpected gift", "a winter storm",
        "a family recipe", "learning to swim", "a broken clock", "a desert road", "a new job",
        "the night sky", "a museum visit", "a stray cat", "a bicycle trip", "a quiet morning",
        "a wedding", "a volunteer project", "a power outage",
    ],
    "roleplay": [
        "a medieval knight", "a tour guide in Rome", "a pirate captain", "a detective",
        "a personal trainer", "a chef in a busy kitchen", "a job interviewer", "a museum curator",
        "a space station commander", "a customer service agent", "a history teacher",
        "a travel agent", "a wise old wizard", "a sports commentator", "a park ranger",
        "a librarian", "a startup founder pitching investors", "a news anchor", "a tailor",
        "a ship's navigator", "a game show host", "a gardener", "a radio DJ", "a robot butler",
        "a marathon coach", "a bookshop owner", "a mountain guide", "a hotel receptionist",
        "a film director", "a barista",
    ],
    "reasoning": [
        "why the sky is blue", "whether a tomato is a fruit", "how to split a bill fairly",
        "planning a week of meals on a budget", "choosing between two job offers",
        "why ice floats", "how a queue at a bank could be shortened", "the Monty Hall problem",
        "why leap years exist", "how to schedule three meetings without overlap",
        "whether to repair or replace an old laptop", "how to pack a small suitcase",
        "why bread goes stale", "how to find a lost key in a house", "the river crossing puzzle",
        "why some bridges have expansion joints", "how to organise a bookshelf",
        "the best order to run errands", "why coffee cools faster in a wide mug",
        "how to divide chores among roommates", "whether to take the stairs or the lift",
        "why shadows are longer in winter", "how to plan a road trip with two drivers",
        "a logic puzzle about three boxes of fruit", "why planes fly higher on long routes",
        "how to estimate the number of piano tuners in a city", "why cats land on their feet",
        "how to settle a disagreement about a movie night", "why cities are warmer",
        "how to save for a bicycle in six months",
    ],
    "coding": [
        "reverses a string", "checks whether a number is prime", "merges two sorted lists",
        "counts the words in a text", "finds the largest element in a list",
        "computes a factorial", "removes duplicates from a list", "validates an email address",
        "converts Celsius to Fahrenheit", "reads a CSV file and sums a column",
        "implements binary search", "flattens a nested list", "checks for a palindrome",
        "computes the Fibonacci sequence", "sorts a list of dictionaries by a key",
        "finds the most common letter in a string", "implements a stack", "parses a date string",
        "computes the greatest common divisor", "generates a random password",
        "checks balanced parentheses", "transposes a matrix", "counts vowels in a string",
        "implements bubble sort", "converts a number to Roman numerals", "rotates a list",
        "computes the average of a list", "finds common elements of two lists",
        "capitalises every word in a sentence", "implements a simple linked list",
    ],
    "extraction": [
        "the dates and events", "the names of people", "the prices and products",
        "the cities mentioned", "the main argument", "the ingredients and quantities",
        "the key numbers", "the action items", "the company names", "the time and place",
    ],
    "stem": [
        "photosynthesis", "black holes", "the water cycle", "DNA replication", "plate tectonics",
        "electric circuits", "the immune system", "climate change", "vaccines", "gravity",
        "the periodic table", "how batteries work", "the speed of light", "volcanoes",
        "machine learning", "the human heart", "antibiotics", "renewable energy", "magnetism",
        "the Big Bang", "evolution by natural selection", "sound waves", "the ozone layer",
        "nuclear fission", "how computers store data", "the solar system", "enzymes",
        "earthquakes", "the greenhouse effect", "how vision works",
    ],
    "humanities": [
        "the Renaissance", "the French Revolution", "the Silk Road", "ancient Egypt",
        "the printing press", "the Industrial Revolution", "Greek philosophy", "the Cold War",
        "the Roman Empire", "impressionist painting", "the invention of writing",
        "the history of jazz", "Shakespeare's plays", "the Magna Carta", "the Ming dynasty",
        "the abolition of slavery", "the history of the Olympic Games", "Buddhism",
        "the Enlightenment", "the age of exploration", "the history of democracy",
        "the Aztec civilisation", "Baroque music", "the women's suffrage movement",
        "the Ottoman Empire", "existentialism", "the history of money", "the Vikings",
        "the Harlem Renaissance", "the history of maps",
    ],
    "chitchat": [
        "your favourite season", "a good book to read", "weekend plans", "learning a new hobby",
        "staying motivated", "the best way to relax", "making new friends", "cooking at home",
        "a fun fact", "morning routines", "travelling on a budget", "keeping plants alive",
        "board games", "getting better sleep", "learning a language", "a good movie",
        "a healthy breakfast", "working from home", "keeping a journal", "walking every day",
    ],
}

TEMPLATES = {
    "writing": [
        "Write a short story about {t}.", "Write a poem about {t}.",
        "Write a blog post about {t}.", "Describe {t} in vivid detail.",
        "Write a diary entry about {t}.", "Write a haiku about {t}.",
        "Write the opening paragraph of a novel about {t}.", "Write a letter to a friend about {t}.",
        "Write a short speech about {t}.", "Write a product description inspired by {t}.",
        "Write a limerick about {t}.", "Write a persuasive paragraph about {t}.",
    ],
    "roleplay": [
        "Pretend you are {t}. Introduce yourself.", "You are {t}. Describe your typical day.",
        "Act as {t} and give me advice.", "Imagine you are {t}. What is your biggest challenge?",
        "Role-play as {t} greeting a new visitor.", "As {t}, tell me a story from your work.",
        "You are {t}. Answer my question: what do you enjoy most?",
        "Play the part of {t} and explain your job to a child.",
        "Speak as {t} and describe the tools you use.",
        "You are {t}. Give a short motivational talk.",
    ],
    "reasoning": [
        "Explain step by step {t}.", "Think carefully and reason about {t}.",
        "Give a logical explanation of {t}.", "Walk me through {t}.",
        "What is the reasoning behind {t}?", "Help me think through {t}.",
        "Explain {t} to a ten-year-old.", "List the steps for {t}.",
        "What are the pros and cons when thinking about {t}?", "Briefly analyse {t}.",
    ],
    "coding": [
        "Write a Python function that {t}.", "Write a JavaScript function that {t}.",
        "Show me a C function that {t}.", "Write a Python class that {t}.",
        "Explain how to write a program that {t}.", "Write a short Python script that {t}.",
        "Write a function in Java that {t}.", "Give a Rust function that {t}.",
        "Write a Python one-liner that {t}, and explain it.",
        "Write a function that {t} and add a docstring.",
    ],
    "stem": [
        "Explain {t}.", "What is {t}?", "How does {t} work?", "Summarise the science of {t}.",
        "Explain {t} in simple terms.", "What are the key facts about {t}?",
        "Why is {t} important?", "Give three interesting facts about {t}.",
        "Describe {t} for a high school student.", "What are common misconceptions about {t}?",
        "How would you teach {t}?", "What questions do scientists still have about {t}?",
        "Write a short quiz about {t}.", "Compare {t} with a related idea.",
        "Explain the history of research on {t}.", "What would happen without {t}?",
    ],
    "humanities": [
        "Tell me about {t}.", "What was the significance of {t}?", "Summarise {t}.",
        "Explain the causes and effects of {t}.", "Who were the key figures of {t}?",
        "How did {t} influence the modern world?", "Write a short essay on {t}.",
        "What can we learn from {t}?", "Describe daily life during {t}.",
        "Give a timeline of {t}.", "What are the main debates about {t}?",
        "Explain {t} to a beginner.", "Compare {t} with another period or idea.",
        "Why do historians study {t}?", "What art or writing came out of {t}?",
        "Give three surprising facts about {t}.",
    ],
    "chitchat": [
        "Let's chat about {t}.", "What do you think about {t}?", "Any tips for {t}?",
        "Tell me something nice about {t}.", "I'd like to talk about {t}.",
        "Can you give me ideas for {t}?", "How can I get better at {t}?",
        "What's your take on {t}?", "Share a few thoughts on {t}.", "Hi! Talk to me about {t}.",
    ],
}

# Requests often come with a constraint on the form of the answer; each template x topic prompt
# is asked once as is and once with one of these.
CONSTRAINTS = [
    "Keep it under 100 words.", "Use bullet points.", "Answer in three sentences.",
    "Make it funny.", "Use simple words.", "Be formal.", "End with a question.",
    "Give one concrete example.", "Start with a title.", "Write it for a child.",
    "Be concise.", "Use a numbered list.",
]

NAMES = ["Alice", "Bob", "Carmen", "Deepak", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Hanoi", "Cairo", "Dublin"]
PRODUCTS = ["lamp", "kettle", "backpack", "notebook", "bicycle", "blender", "umbrella", "chair"]
MONTHS = ["January", "March", "May", "July", "September", "November"]


def extraction_passage(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    c1, c2 = rng.sample(CITIES, 2)
    p1, p2 = rng.sample(PRODUCTS, 2)
    return (f"On {rng.randint(1, 28)} {rng.choice(MONTHS)} {rng.randint(1990, 2024)}, {a} "
            f"travelled from {c1} to {c2} to meet {b}. They bought a {p1} for "
            f"${rng.randint(5, 300)} and a {p2} for ${rng.randint(5, 300)}, and agreed to "
            f"meet again in {rng.randint(2, 11)} weeks.")


def math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    name, item = rng.choice(NAMES), rng.choice(PRODUCTS)
    return rng.choice([
        f"What is {a} + {b} * {c}?",
        f"Solve for x: {c}x + {a} = {a + b * c}.",
        f"{name} buys {c} {item}s at ${a} each. How much does {name} pay?",
        f"A train travels {a * c} km in {c} hours. What is its average speed?",
        f"What is {a}% of {b * 10}?",
        f"Find the area of a rectangle {a} cm by {b} cm.",
        f"If {name} saves ${a} a week, how many weeks to save ${a * c * 4}?",
        f"What is the least common multiple of {c} and {b}?",
        f"Simplify the fraction {a * c}/{b * c}.",
        f"A recipe needs {c} eggs for {a} cookies. How many eggs for {a * 3} cookies?",
    ])


def seed_prompts(seed: int = 0, n_math: int = 1200, n_extraction: int = 600) -> list[dict]:
    """Every template x topic (as is and with a constraint), plus generated math and extraction
    prompts; deduplicated and shuffled deterministically."""
    rng = random.Random(seed)
    base = [{"category": cat, "prompt": tpl.format(t=topic)}
            for cat, templates in TEMPLATES.items() for tpl in templates for topic in TOPICS[cat]]
    prompts = base + [{"category": p["category"],
                       "prompt": f"{p['prompt']} {rng.choice(CONSTRAINTS)}"} for p in base]
    prompts += [{"category": "math", "prompt": math_problem(rng)} for _ in range(n_math)]
    prompts += [{"category": "extraction",
                 "prompt": f"Extract {rng.choice(TOPICS['extraction'])} from this text:\n\n"
                           f"{extraction_passage(rng)}"} for _ in range(n_extraction)]
    unique = list({p["prompt"]: p for p in prompts}.values())
    rng.shuffle(unique)
    return unique


def main():
    p = argparse.ArgumentParser(description="Write the self-distillation seed prompts (JSONL).")
    p.prog = "python -m minimedusa.training.seed_prompts"  # as typed (else argparse names the file)
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed (default: %(default)s)")
    args = p.parse_args()
    prompts = seed_prompts(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(args.out, lambda tmp: tmp.write_text(
        "".join(json.dumps(x) + "\n" for x in prompts)))
    counts = {}
    for x in prompts:
        counts[x["category"]] = counts.get(x["category"], 0) + 1
    print(f"wrote {len(prompts)} prompts to {args.out}: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
