"""Training prompts for the self-distilled EAGLE data, generated offline.

Three sources, none of them the evaluation prompts (``spec_plugins.prompts``):

* general requests: templates x topics (questions, explanations, writing);
* code: functions of the Python standard library (name, signature and the
  first lines of their docstrings) as "complete this function" / "write a
  function" requests, the same shape as the HumanEval evaluation prompts but
  other functions;
* arithmetic word problems with seeded random numbers.

``training_prompts(n, seed)`` is deterministic and raises if any prompt equals
an evaluation prompt.
"""

from __future__ import annotations

import importlib
import inspect
import random

from spec_plugins.prompts import HUMANEVAL_INSTRUCTION

TOPICS = [
    "volcanoes", "the French Revolution", "electric cars", "honey bees", "the stock market", "quantum computing",
    "the Roman Empire", "coral reefs", "machine learning", "the human heart", "earthquakes", "solar panels",
    "the printing press", "rainforests", "antibiotics", "the moon landing", "cryptocurrency", "jazz music",
    "the Great Wall of China", "tides", "nuclear energy", "the immune system", "democracy", "glaciers",
    "the Renaissance", "wind turbines", "DNA", "chess", "the Industrial Revolution", "deserts",
    "social media", "recycling", "the periodic table", "dinosaurs", "gravity", "meditation", "the Olympic Games",
    "bread baking", "compound interest", "airplanes", "the nervous system", "Shakespeare", "tea", "bicycles",
    "the ozone layer", "time zones", "the Amazon river", "electricity", "magnets", "sleep", "volunteering",
    "public speaking", "urban gardening", "the Cold War", "penguins", "the Silk Road", "3D printing",
    "operating systems", "databases", "encryption", "open source software", "cloud computing", "robots",
    "the history of writing", "mountains", "rivers", "the Sahara", "classical music", "impressionist painting",
    "photography", "origami", "the metric system", "vitamins", "nutrition", "marathon training", "yoga",
    "the Pythagorean theorem", "probability", "statistics", "prime factorization", "fractions", "algebra",
    "geometry", "calculus", "the speed of light", "rainbows", "thunderstorms", "hurricanes", "snowflakes",
    "bees and pollination", "the food chain", "evolution", "fossils", "the Big Bang", "comets", "Mars",
    "Jupiter", "satellites", "GPS", "smartphones", "batteries", "semiconductors", "the World Wide Web",
    "email etiquette", "job interviews", "budgeting", "saving for retirement", "learning a new language",
    "time management", "teamwork", "leadership", "negotiation", "friendship", "gardening", "composting",
    "camping", "cooking rice", "coffee brewing", "chocolate", "cheese making", "the Vikings",
    "ancient Egypt", "the Aztecs", "Greek mythology", "the Moon", "octopuses", "whales", "elephants",
    "migratory birds", "forests", "wetlands", "climate change", "plastic pollution", "water purification",
    "bridges", "skyscrapers", "trains", "ships", "the compass", "maps", "libraries", "museums", "theater",
]

TEMPLATES = [
    "What is {t}?", "Tell me about {t}.", "Give me three interesting facts about {t}.",
    "Explain {t} in simple terms.", "Why is {t} important?", "Write a short paragraph about {t}.",
    "Write a short poem about {t}.", "What are the pros and cons of {t}?", "How would you teach {t} to a child?",
    "Summarize the history of {t}.", "Write a blog post introduction about {t}.",
    "What are common misconceptions about {t}?", "Describe {t} in five sentences.",
    "Write a short story that involves {t}.", "List five questions a student might ask about {t}.",
    "How does {t} affect everyday life?", "Write a tweet about {t}.", "Compare {t} and {u}.",
]

CODE_TEMPLATES = [
    "Write a Python function `{name}{sig}` that does the following: {doc}",
    "Implement `{name}{sig}` in Python. {doc}",
    "Explain what the Python function `{module}.{name}` does and show an example of using it.",
]

STDLIB_MODULES = [
    "os.path", "shutil", "string", "textwrap", "statistics", "math", "bisect", "heapq", "itertools",
    "functools", "operator", "json", "base64", "binascii", "calendar", "colorsys", "difflib", "fnmatch",
    "glob", "html", "ipaddress", "keyword", "posixpath", "random", "re", "shlex", "urllib.parse",
    "collections", "copy", "datetime", "decimal", "fractions", "hashlib", "inspect", "linecache",
    "locale", "pprint", "quopri", "secrets", "tempfile", "uuid", "zlib", "gzip", "csv", "configparser",
    "email.utils", "mimetypes", "numbers", "typing", "warnings", "weakref", "zipfile", "tarfile",
]


def _stdlib_functions() -> list[tuple[str, str, str, str]]:
    """(module, name, signature, docstring) of documented pure-Python stdlib functions."""
    out = []
    for mod_name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != mod.__name__:
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 30:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            doc = "\n".join(doc.splitlines()[:8]).strip()
            out.append((mod_name, name, sig, doc))
    return out


def _code_prompts(rng: random.Random) -> list[str]:
    prompts = []
    for module, name, sig, doc in _stdlib_functions():
        body = f'def {name}{sig}:\n    """{doc.replace(chr(10), chr(10) + "    ")}\n    """\n'
        prompts.append(HUMANEVAL_INSTRUCTION.format(prompt=body))
        template = rng.choice(CODE_TEMPLATES)
        prompts.append(template.format(name=name, sig=sig, doc=doc.splitlines()[0], module=module))
    return prompts


def _math_prompts(rng: random.Random, n: int) -> list[str]:
    kinds = [
        lambda a, b: f"What is {a} plus {b}? Explain the steps.",
        lambda a, b: f"Compute {a} times {b} step by step.",
        lambda a, b: f"A store sells pencils for {b} cents each. How much do {a} pencils cost in dollars?",
        lambda a, b: f"If I walk {a} meters every day for {b} days, how far do I walk in total?",
        lambda a, b: f"What is {a} percent of {b * 10}?",
        lambda a, b: f"Solve the equation {a}x - {b} = {a * 3 - b}.",
        lambda a, b: f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        lambda a, b: f"Is {a * b + 1} a prime number? Explain how you check.",
    ]
    return [rng.choice(kinds)(rng.randint(2, 99), rng.randint(2, 60)) for _ in range(n)]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct training prompts (seeded shuffle of all sources)."""
    rng = random.Random(seed)
    general = []
    for t in TOPICS:
        for template in TEMPLATES:
            u = rng.choice([x for x in TOPICS if x != t])
            general.append(template.format(t=t, u=u))
    rng.shuffle(general)
    code = list(dict.fromkeys(_code_prompts(rng)))
    rng.shuffle(code)
    math = list(dict.fromkeys(_math_prompts(rng, max(n // 4, 100))))
    # Mix: about 45% general, 40% code, 15% arithmetic.
    n_code = min(len(code), int(n * 0.40))
    n_math = min(len(math), int(n * 0.15))
    general = [g for g in dict.fromkeys(general) if g not in set(code) | set(math)]
    pool = code[:n_code] + math[:n_math] + general[: n - n_code - n_math]
    rng.shuffle(pool)
    if len(pool) < n:
        raise ValueError(f"only {len(pool)} distinct training prompts available, {n} requested")
    assert_disjoint_from_eval(pool)
    return pool[:n]


def assert_disjoint_from_eval(prompts: list[str]) -> None:
    from spec_plugins.prompts import chat_prompts, humaneval_prompts

    evals = {p.text.strip() for p in chat_prompts() + humaneval_prompts()}
    overlap = [p for p in prompts if p.strip() in evals]
    if overlap:
        raise AssertionError(f"{len(overlap)} training prompts equal evaluation prompts, e.g. {overlap[0]!r}")
