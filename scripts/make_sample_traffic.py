"""Regenerate the shipped sample traffic: tasks/data/sample_traffic.jsonl.gz.

Builds realistic requests across the domains json, code, summarize, qa, chat and creative (code
prompts are cut from real Python standard-library source files, summaries from real stdlib
docstrings), answers each one with the embedded default target through specdec_core (a mix of
greedy and sampled decoding; the sampling params are recorded with each row), and writes one
request per line in the format `specdec traffic import` reads.

Resumable and batched: finished requests are appended to a partial file (one flush per batch);
a re-run skips the ids already there and, once every request is done, writes the compressed file.

    SPECDEC_HOME=/tmp/sdhome nice -n 19 python scripts/make_sample_traffic.py            # full run
    python scripts/make_sample_traffic.py --limit 32 --out /tmp/small.jsonl.gz             # a quick one
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import logging
import random
import sysconfig
import textwrap
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

log = logging.getLogger("make_sample_traffic")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tasks" / "data" / "sample_traffic.jsonl.gz"
MODEL = "smollm2-135m-instruct"
# The window the timestamps span: two weeks ending here (fixed, so a re-run gives the same file).
WINDOW_END = datetime(2025, 11, 17, 18, 0, tzinfo=timezone.utc)
WINDOW_DAYS = 14
PER_DOMAIN = 110
MAX_PROMPT_CHARS = 1400

# (name, temperature, top_k, top_p, share): the sampling settings production traffic used.
SAMPLING_MIX = [
    ("greedy", 0.0, 0, 1.0, 0.40),
    ("t0.7-p0.9", 0.7, 0, 0.9, 0.25),
    ("t1.0", 1.0, 0, 1.0, 0.15),
    ("t0.8-k50", 0.8, 50, 1.0, 0.10),
    ("t0.3", 0.3, 0, 1.0, 0.10),
]

# ------------------------------------------------------------------------------------------------
# content pools
FIRST_NAMES = ["Maria", "Jonas", "Aisha", "Kenji", "Lucia", "Tomasz", "Priya", "Olu", "Sven", "Mei",
               "Diego", "Fatima", "Hugo", "Ingrid", "Rahul", "Chloe", "Mateo", "Yara", "Leon", "Nadia"]
LAST_NAMES = ["Lopez", "Berg", "Khan", "Tanaka", "Rossi", "Nowak", "Sharma", "Adeyemi", "Larsen",
              "Chen", "Garcia", "Haddad", "Martin", "Olsen", "Gupta", "Dubois", "Silva", "Weber"]
CITIES = [("Valencia", "Spain"), ("Porto", "Portugal"), ("Lyon", "France"), ("Gdansk", "Poland"),
          ("Osaka", "Japan"), ("Pune", "India"), ("Lagos", "Nigeria"), ("Bergen", "Norway"),
          ("Austin", "USA"), ("Leeds", "UK"), ("Graz", "Austria"), ("Curitiba", "Brazil"),
          ("Tartu", "Estonia"), ("Cork", "Ireland"), ("Brno", "Czechia"), ("Quebec", "Canada")]
PRODUCTS = [("espresso beans 1kg", 18.9), ("oat milk", 2.15), ("USB-C cable", 9.99),
            ("desk lamp", 34.5), ("notebook A5", 4.2), ("running socks", 12.0),
            ("water bottle", 15.75), ("wireless mouse", 24.99), ("green tea 100g", 6.4),
            ("phone stand", 11.3), ("hdmi adapter", 13.8), ("backpack 20l", 49.0)]
SERVICES = ["checkout", "search-api", "billing", "auth", "inventory", "notifications", "reporting",
            "gateway", "recommendations", "media-upload"]
TOPICS = ["the ocean at night", "a city waking up", "an old lighthouse", "the first snow",
          "a robot learning to paint", "a lost umbrella", "autumn in the mountains", "a train station",
          "a cat who runs a bakery", "the last day of summer", "a library after closing",
          "a message in a bottle", "a garden on a rooftop", "a dragon afraid of the dark",
          "a marathon runner", "the smell of rain", "a deep-sea diver", "a village market",
          "two friends reuniting", "a broken clock", "a lighthouse keeper's diary", "a comet"]
QA_FACTS = [
    "What is the capital of {country}?",
    "Which ocean is the largest on Earth?",
    "Why is the sky blue?",
    "How many bones are in the adult human body?",
    "What causes the seasons on Earth?",
    "Who wrote 'Pride and Prejudice'?",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "What does DNA stand for?",
    "How long does light from the Sun take to reach Earth?",
    "What is photosynthesis?",
    "What is the speed of sound in air?",
    "Which planet has the most moons?",
    "What is the difference between weather and climate?",
    "When did the Berlin Wall fall?",
    "What is the chemical symbol for gold?",
    "How does a vaccine work?",
    "What is the tallest mountain in {continent}?",
    "What language is spoken in {country}?",
    "What currency does {country} use?",
    "Roughly how many people live in {country}?",
]
QA_TECH_PAIRS = [("TCP", "UDP"), ("a process", "a thread"), ("RAM", "ROM"), ("HTTP", "HTTPS"),
                 ("a list", "a tuple in Python"), ("SQL", "NoSQL databases"), ("git merge", "git rebase"),
                 ("a compiler", "an interpreter"), ("IPv4", "IPv6"), ("latency", "throughput"),
                 ("a mutex", "a semaphore"), ("an index", "a primary key"), ("JSON", "XML"),
                 ("unit tests", "integration tests"), ("a CPU", "a GPU"), ("SSD", "HDD")]
QA_HOWTO = ["How do I convert {a} {u1} to {u2}?", "How many {u2} are in {a} {u1}?"]
UNITS = [("miles", "kilometers"), ("pounds", "kilograms"), ("liters", "gallons"),
         ("feet", "meters"), ("cups", "milliliters"), ("hours", "seconds")]
CONTINENTS = ["Africa", "Europe", "South America", "Asia", "North America", "Oceania"]
CHAT_OPENERS = [
    "Hi! Can you help me plan a {days}-day trip to {city}? I like {hobby} and good food.",
    "I have a job interview for a {job} position next week. What questions should I prepare for?",
    "My friend's birthday is on Saturday and she loves {hobby}. Any gift ideas under 40 euros?",
    "Can you suggest a simple weekly workout plan for someone who only has {mins} minutes a day?",
    "I keep procrastinating on my {task}. Any tips that actually work?",
    "What should I cook tonight? I have {ing1}, {ing2} and some {ing3}.",
    "Please rewrite this message so it sounds more polite: '{rude}'",
    "Can you draft a short email to {name} ({email}) saying I will be late to the {meeting} meeting?",
    "I'm learning {lang_}. What's a good way to practice speaking every day?",
    "I feel a bit stressed about moving to {city}. How do people usually settle in quickly?",
    "Recommend three books for someone who enjoyed {book}.",
    "How do I politely decline an invitation to {event}?",
    "Give me a packing list for a {days}-day hiking trip in {season}.",
    "My {pet} keeps waking me up at 5am. What can I do?",
    "Can you explain {concept} to me like I'm twelve?",
]
HOBBIES = ["hiking", "photography", "board games", "jazz", "street food", "museums", "cycling",
           "gardening", "pottery", "climbing"]
JOBS = ["data analyst", "backend engineer", "product manager", "nurse", "UX designer",
        "sales associate", "teacher", "site reliability engineer"]
TASKS_ = ["thesis", "tax return", "side project", "garage cleanup", "language course", "portfolio"]
INGREDIENTS = ["chickpeas", "spinach", "rice", "eggs", "tomatoes", "tofu", "feta", "potatoes",
               "lentils", "mushrooms", "salmon", "peppers"]
RUDE = ["Send me the report now, you are late again.", "Why didn't you answer my email yesterday?",
        "This design is wrong, redo it.", "Stop booking meetings at 8am.",
        "I need the invoice today, not next week."]
MEETINGS = ["Monday stand-up", "quarterly planning", "design review", "budget", "client kickoff"]
LANGS = ["Spanish", "Japanese", "German", "Portuguese", "Italian", "Korean"]
BOOKS = ["The Martian", "Project Hail Mary", "Sapiens", "The Hobbit", "Educated", "Dune"]
EVENTS = ["a wedding", "a team dinner", "a weekend trip", "a networking event", "a baby shower"]
SEASONS = ["spring", "late autumn", "summer", "winter"]
PETS = ["cat", "dog", "parrot"]
CONCEPTS = ["inflation", "how the internet works", "compound interest", "black holes",
            "machine learning", "why we dream", "how vaccines work", "the stock market"]
CHAT_FOLLOWUPS = ["Thanks! Can you make it shorter?", "Could you put that in a bulleted list?",
                  "Can you give me one more option?", "OK, and what should I avoid?",
                  "Perfect. Can you say it in a more casual tone?"]
HANDMADE = ["ceramic mugs", "leather wallets", "beeswax candles", "knitted scarves",
            "wooden cutting boards", "linen tote bags"]
CREATIVE_FORMS = [
    "Write a haiku about {topic}.",
    "Write a short poem (four lines) about {topic}.",
    "Write the opening paragraph of a mystery story set in {city}.",
    "Write a limerick about a {job} who loves {hobby}.",
    "Give me a catchy slogan for a small {shop} in {city}.",
    "Write a two-sentence horror story about {topic}.",
    "Describe {topic} in the style of a nature documentary narrator.",
    "Write a short bedtime story about {topic} for a five-year-old.",
    "Write a product description for handmade {product}, warm and playful in tone.",
    "Write a toast for my {relation}'s {occasion}, funny but kind.",
    "Invent a name and a one-line backstory for a fantasy character who is a {job}.",
    "Write song lyrics (one verse and a chorus) about {topic}.",
]
SHOPS = ["coffee shop", "bike repair shop", "bookstore", "bakery", "plant nursery", "vinyl store"]
RELATIONS = ["brother", "best friend", "grandmother", "colleague", "sister"]
OCCASIONS = ["wedding", "retirement party", "40th birthday", "graduation"]
SUMMARY_ASKS = [
    "Summarize the following text in two sentences:\n\n{text}",
    "TL;DR this for me:\n\n{text}",
    "Give me three bullet points that capture the main ideas of this passage:\n\n{text}",
    "Summarize this documentation for a busy developer, one short paragraph:\n\n{text}",
    "What is the gist of the following? Answer in one sentence.\n\n{text}",
    "Write a short abstract (under 50 words) for this text:\n\n{text}",
]
CODE_ASKS = [
    "Explain what this Python function does:\n\n```python\n{code}\n```",
    "Add a docstring to this function and return the whole function:\n\n```python\n{code}\n```",
    "Write pytest unit tests for this function:\n\n```python\n{code}\n```",
    "Add type hints to this code:\n\n```python\n{code}\n```",
    "Is there a bug or an edge case this function does not handle?\n\n```python\n{code}\n```",
    "Refactor this function to be more readable, keep the behaviour identical:\n\n```python\n{code}\n```",
    "Rewrite this Python function in JavaScript:\n\n```python\n{code}\n```",
    "What is the time complexity of this code?\n\n```python\n{code}\n```",
    "I found this in the {module} module. Walk me through it line by line:\n\n```python\n{code}\n```",
]
JSON_ASKS = [
    "Here is a customer record as JSON:\n{record}\nReturn the same JSON object with the field "
    "\"plan\" changed to \"{plan}\". Output only the JSON.",
    "Extract the name and the city from this JSON and return them as a JSON object with keys "
    "\"name\" and \"city\":\n{record}",
    "Convert these lines into a JSON array of objects with keys \"product\", \"quantity\" and "
    "\"price\":\n{lines}",
    "Write a JSON Schema for objects like this one:\n{record}",
    "Fix the syntax of this JSON and output it:\n{broken}",
    "Turn this sentence into JSON with keys \"person\", \"action\", \"date\": {sentence}",
    "Here is an order as JSON:\n{order}\nAdd a field \"total\" with the order total and output the JSON.",
    "Return a JSON object describing the deployment: service {service}, {replicas} replicas, "
    "port {port}, environment {env}. Keys: service, replicas, port, env.",
    "Validate this JSON config and list any problems as a JSON array of strings:\n{config}",
]


def _person(rng: random.Random) -> dict:
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    city, country = rng.choice(CITIES)
    return {"id": rng.randint(1000, 99999), "name": f"{first} {last}", "city": city,
            "country": country, "plan": rng.choice(["free", "basic", "premium"]),
            "orders": rng.randint(0, 60), "newsletter": rng.random() < 0.5}


def json_prompt(rng: random.Random) -> str:
    template = rng.choice(JSON_ASKS)
    person = _person(rng)
    items = rng.sample(PRODUCTS, rng.randint(2, 5))
    lines = "\n".join(f"product: {name}, quantity: {rng.randint(1, 12)}, price: {price:.2f}"
                      for name, price in items)
    order = {"order_id": f"ORD-{rng.randint(10000, 99999)}", "customer": person["name"],
             "items": [{"product": name, "quantity": rng.randint(1, 5), "unit_price": price}
                       for name, price in items]}
    config = {"service": rng.choice(SERVICES), "replicas": rng.choice([2, 3, "three", -1]),
              "timeout_ms": rng.choice([2500, "2.5s", 0]), "log_level": rng.choice(["info", "verbose"])}
    broken = json.dumps(person)[:-1].replace(", \"orders\"", ",, \"orders\"") + ","
    sentence = (f"{person['name']} {rng.choice(['renewed', 'cancelled', 'upgraded'])} the "
                f"subscription on {rng.randint(1, 28)} {rng.choice(['March', 'June', 'October'])}.")
    return template.format(record=json.dumps(person), plan=rng.choice(["enterprise", "team"]),
                           lines=lines, broken=broken, sentence=sentence,
                           order=json.dumps(order), service=rng.choice(SERVICES),
                           replicas=rng.randint(1, 8), port=rng.choice([8080, 8443, 9000, 5000]),
                           env=rng.choice(["staging", "production", "dev"]), config=json.dumps(config))


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    files += sorted(p for pkg in ("json", "email", "http", "logging", "urllib", "collections",
                                  "importlib", "asyncio", "concurrent/futures")
                    for p in (root / pkg).glob("*.py") if not p.name.startswith("__"))
    return files


def stdlib_functions(max_lines: int = 30) -> list[tuple[str, str]]:
    """(module name, source) of short top-level or method functions from the standard library."""
    found = []
    for path in _stdlib_files():
        try:
            source = path.read_text("utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno <= max_lines:
                lines = source.splitlines()[node.lineno - 1: node.end_lineno]
                segment = textwrap.dedent("\n".join(lines))
                if not node.name.startswith("__") and len(segment) < MAX_PROMPT_CHARS:
                    found.append((path.stem, segment))
    return found


def stdlib_docstrings(min_chars: int = 300) -> list[str]:
    """Prose paragraphs from module, class and function docstrings of the standard library."""
    found = []
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text("utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and min_chars <= len(doc) and ">>>" not in doc:
                    found.append(doc[:MAX_PROMPT_CHARS].rsplit("\n", 1)[0] if len(doc) > MAX_PROMPT_CHARS
                                 else doc)
    return found


def code_prompt(rng: random.Random, functions: list[tuple[str, str]]) -> str:
    module, code = rng.choice(functions)
    return rng.choice(CODE_ASKS).format(code=code, module=module)


def summarize_prompt(rng: random.Random, docstrings: list[str]) -> str:
    if rng.random() < 0.6:
        text = rng.choice(docstrings)
    else:
        text = _synthetic_report(rng)
    return rng.choice(SUMMARY_ASKS).format(text=text)


def _synthetic_report(rng: random.Random) -> str:
    service = rng.choice(SERVICES)
    kind = rng.choice(["incident", "meeting", "review"])
    if kind == "incident":
        minutes = rng.randint(7, 95)
        return (f"At {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} UTC the {service} service "
                f"started returning errors for about {rng.randint(2, 40)}% of requests. The on-call "
                f"engineer traced it to a {rng.choice(['expired certificate', 'full disk', 'bad config push', 'connection pool leak'])} "
                f"and rolled back within {minutes} minutes. Customer impact: "
                f"{rng.choice(['checkout failures', 'slow page loads', 'failed logins', 'delayed emails'])}. "
                f"Follow-ups: add an alert on the root cause, write a runbook entry, and review the "
                f"deploy checklist with the {rng.choice(['platform', 'payments', 'identity'])} team.")
    if kind == "meeting":
        a, b = rng.sample(FIRST_NAMES, 2)
        return (f"Attendees: {a}, {b} and the {service} team. {a} presented the Q{rng.randint(1, 4)} "
                f"roadmap; the main risk is the migration to the new "
                f"{rng.choice(['database', 'queue', 'CI system', 'auth provider'])}, which slipped by "
                f"{rng.randint(1, 6)} weeks. {b} asked whether the load tests cover peak traffic; they "
                f"do not yet. Decisions: freeze new features for two sprints, hire one contractor, and "
                f"revisit the budget on the next call. Action items were assigned to {a} and {b}.")
    product, _ = rng.choice(PRODUCTS)
    stars = rng.randint(1, 5)
    return (f"Customer review ({stars}/5) for the {product}: I ordered it on a "
            f"{rng.choice(['Monday', 'Friday', 'Sunday'])} and it arrived "
            f"{rng.choice(['two days later', 'a week late', 'the next morning'])}. "
            f"{'The quality is great and I would buy it again.' if stars > 3 else 'It stopped working after a few uses and support was slow to reply.'} "
            f"Packaging was {rng.choice(['excessive', 'fine', 'minimal and recyclable'])}. "
            f"Overall {'recommended' if stars > 3 else 'disappointed'}.")


def qa_prompt(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.55:
        return rng.choice(QA_FACTS).format(country=rng.choice(CITIES)[1], continent=rng.choice(CONTINENTS))
    if roll < 0.85:
        a, b = rng.choice(QA_TECH_PAIRS)
        return rng.choice(["What is the difference between {a} and {b}?",
                           "When should I use {a} instead of {b}?",
                           "Explain {a} vs {b} briefly."]).format(a=a, b=b)
    u1, u2 = rng.choice(UNITS)
    return rng.choice(QA_HOWTO).format(a=rng.choice([3, 5, 12, 26.2, 100]), u1=u1, u2=u2)


def chat_messages(rng: random.Random) -> list[dict]:
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    ing1, ing2, ing3 = rng.sample(INGREDIENTS, 3)
    text = rng.choice(CHAT_OPENERS).format(
        days=rng.randint(2, 7), city=rng.choice(CITIES)[0], hobby=rng.choice(HOBBIES),
        job=rng.choice(JOBS), mins=rng.choice([15, 20, 30]), task=rng.choice(TASKS_),
        ing1=ing1, ing2=ing2, ing3=ing3,
        rude=rng.choice(RUDE), name=first, email=f"{first.lower()}.{last.lower()}@example.com",
        meeting=rng.choice(MEETINGS), lang_=rng.choice(LANGS), book=rng.choice(BOOKS),
        event=rng.choice(EVENTS), season=rng.choice(SEASONS), pet=rng.choice(PETS),
        concept=rng.choice(CONCEPTS))
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are a friendly, concise assistant."})
    messages.append({"role": "user", "content": text})
    if rng.random() < 0.25:  # a second turn: the earlier answer is part of the logged prompt
        messages.append({"role": "assistant", "content": "Sure! Here are a few ideas to start with."})
        messages.append({"role": "user", "content": rng.choice(CHAT_FOLLOWUPS)})
    return messages


def creative_prompt(rng: random.Random) -> str:
    return rng.choice(CREATIVE_FORMS).format(
        topic=rng.choice(TOPICS), city=rng.choice(CITIES)[0], job=rng.choice(JOBS),
        hobby=rng.choice(HOBBIES), shop=rng.choice(SHOPS), product=rng.choice(HANDMADE),
        relation=rng.choice(RELATIONS), occasion=rng.choice(OCCASIONS))


# vary=True: how a prompt the pools have already given is reworded (a domain's pool holds fewer
# distinct prompts than a large run asks for; qa has under 200)
VARY_PREFIXES = ["", "Quick question: ", "Hi! ", "Please help: ", "I was wondering: ", "Hey, ",
                 "Could you help me with this? ", "One more thing. ", "For my notes: "]
VARY_SUFFIXES = ["", " Thanks!", " Please be brief.", " Keep it short.", " Explain step by step.",
                 " Thank you in advance.", " Answer in plain English.", " No need for details.",
                 " Be concise."]


def vary_messages(rng: random.Random, messages: list[dict]) -> list[dict]:
    """The same request reworded: a prefix and a suffix around its last user message."""
    varied = [dict(message) for message in messages]
    last = max(i for i, message in enumerate(varied) if message["role"] == "user")
    varied[last]["content"] = (rng.choice(VARY_PREFIXES) + varied[last]["content"]
                               + rng.choice(VARY_SUFFIXES))
    return varied


def build_requests(per_domain: int, seed: int = 20251117, vary: bool = False) -> list[dict]:
    """Every request (without its response), deterministic for the seed: ids, prompts, settings.
    vary: a prompt already made is reworded (vary_messages) instead of drawn again, so that a
    domain yields more distinct prompts than its pools hold; False (the shipped file) never
    rewords."""
    rng = random.Random(seed)
    functions, docstrings = stdlib_functions(), stdlib_docstrings()
    makers = {
        "json": lambda: [{"role": "user", "content": json_prompt(rng)}],
        "code": lambda: [{"role": "user", "content": code_prompt(rng, functions)}],
        "summarize": lambda: [{"role": "user", "content": summarize_prompt(rng, docstrings)}],
        "qa": lambda: [{"role": "user", "content": qa_prompt(rng)}],
        "chat": lambda: chat_messages(rng),
        "creative": lambda: [{"role": "user", "content": creative_prompt(rng)}],
    }
    weights = [share for *_, share in SAMPLING_MIX]
    requests, seen = [], set()
    for domain, make in makers.items():
        made = misses = 0
        while made < per_domain:
            messages = make()
            key = json.dumps(messages)
            if key in seen and vary:
                messages = vary_messages(rng, messages)
                key = json.dumps(messages)
            if key in seen:  # the pools are finite: no exact duplicate prompts
                misses += 1
                if misses > 1000 * per_domain:
                    raise ValueError(f"domain {domain!r} gave only {made} distinct prompts of the "
                                     f"{per_domain} asked: ask for fewer, or pass vary=True")
                continue
            seen.add(key)
            made += 1
            name, temperature, top_k, top_p, _ = rng.choices(SAMPLING_MIX, weights)[0]
            # busier during working hours: draw the hour of day from a skewed distribution
            day_start = (WINDOW_END - timedelta(days=rng.randrange(1, WINDOW_DAYS + 1))).replace(
                hour=0, minute=0, second=0)
            hour = min(23, max(0, int(rng.gauss(14, 4))))
            stamp = min(WINDOW_END, day_start + timedelta(hours=hour, seconds=rng.randrange(3600)))
            requests.append({
                "id": f"{domain}-{made:04d}", "timestamp": stamp.isoformat().replace("+00:00", "Z"),
                "domain": domain, "messages": messages, "sampling_name": name,
                "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "max_tokens": rng.choice([48, 64]),
            })
    return requests


# ------------------------------------------------------------------------------------------------
def weights_fingerprint(model) -> str:
    """The target's fingerprint id (specdec_core.validation.fingerprint_id of target_fingerprint)."""
    from specdec_core.validation import fingerprint_id, target_fingerprint

    return fingerprint_id(target_fingerprint(model))


def generate(requests: list[dict], partial: Path, batch_size: int) -> None:
    import torch

    from specdec_core import SamplingParams, SpecDecoder, load_model

    done = set()
    if partial.exists():
        with partial.open(encoding="utf-8") as handle:
            for line in handle:
                try:
                    done.add(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError):
                    break  # a torn last line from a killed run: it is redone below
        _truncate_torn_tail(partial)
    todo = [r for r in requests if r["id"] not in done]
    log.info("%d requests, %d already done, %d to generate", len(requests), len(done), len(todo))
    if not todo:
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = load_model(MODEL)
    fingerprint = weights_fingerprint(model)
    decoder = SpecDecoder(model, None)
    tokenizer.padding_side = "left"
    texts = {r["id"]: tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True,
                                                    tokenize=False) for r in todo}
    lengths = {rid: len(tokenizer(text, add_special_tokens=False)["input_ids"])
               for rid, text in texts.items()}
    # one sampling setting and length per call; similar prompt lengths together (less padding)
    groups: dict[tuple, list[dict]] = {}
    for r in todo:
        groups.setdefault((r["sampling_name"], r["max_tokens"]), []).append(r)
    batches = []
    for rows in groups.values():
        rows.sort(key=lambda r: lengths[r["id"]])
        batches += [rows[i: i + batch_size] for i in range(0, len(rows), batch_size)]
    from tqdm import tqdm

    started = time.perf_counter()
    with partial.open("a", encoding="utf-8") as out, tqdm(total=len(todo), unit="req") as bar:
        for batch in batches:
            first = batch[0]
            sampling = SamplingParams(temperature=first["temperature"], top_k=first["top_k"],
                                      top_p=first["top_p"])
            enc = tokenizer([texts[r["id"]] for r in batch], return_tensors="pt", padding=True,
                            add_special_tokens=False)
            seed = int(hashlib.sha256(first["id"].encode()).hexdigest()[:8], 16)
            result = decoder.generate_plain(enc["input_ids"], max_new_tokens=first["max_tokens"],
                                            sampling=sampling, seed=seed,
                                            attention_mask=enc["attention_mask"],
                                            eos_token_id=tokenizer.eos_token_id)
            for row, request in enumerate(batch):
                n = result.num_tokens[row]
                response_ids = result.tokens[row, :n].tolist()
                mask = enc["attention_mask"][row].bool()
                prompt_ids = enc["input_ids"][row][mask].tolist()
                out.write(json.dumps({
                    "id": request["id"], "timestamp": request["timestamp"], "domain": request["domain"],
                    "messages": request["messages"],
                    "response": tokenizer.decode(response_ids, skip_special_tokens=True),
                    "temperature": request["temperature"], "top_k": request["top_k"],
                    "top_p": request["top_p"], "max_tokens": request["max_tokens"],
                    "model": MODEL, "target_fingerprint": fingerprint,
                    "prompt_token_ids": prompt_ids, "response_token_ids": response_ids,
                    "finish_reason": "stop" if response_ids and response_ids[-1] == tokenizer.eos_token_id
                    else "length",
                }, ensure_ascii=False) + "\n")
            out.flush()
            bar.update(len(batch))
    log.info("generated %d responses in %.0f s", len(todo), time.perf_counter() - started)


def _truncate_torn_tail(partial: Path) -> None:
    """Drop a last line without its newline (the run was killed while writing it)."""
    data = partial.read_bytes()
    if data and not data.endswith(b"\n"):
        partial.write_bytes(data[: data.rfind(b"\n") + 1])


def finish(requests: list[dict], partial: Path, out: Path) -> int:
    """Write the compressed file in timestamp order once every request has its response."""
    rows = {}
    with partial.open(encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            rows[row["id"]] = row
    wanted = [r["id"] for r in requests]
    missing = [rid for rid in wanted if rid not in rows]
    if missing:
        raise SystemExit(f"{len(missing)} requests have no response yet (e.g. {missing[:3]}); re-run")
    ordered = sorted((rows[rid] for rid in wanted), key=lambda r: (r["timestamp"], r["id"]))
    tmp = out.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as handle:
        for row in ordered:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(out)
    return len(ordered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--per-domain", type=int, default=PER_DOMAIN)
    parser.add_argument("--limit", type=int, default=None, help="only the first N requests (a quick run)")
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--partial", type=Path, default=None,
                        help="progress file (default: OUT with .partial.jsonl)")
    parser.add_argument("--prompts-only", action="store_true", help="print a few prompts and stop")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    requests = build_requests(args.per_domain)
    if args.limit:
        rng = random.Random(0)
        requests = rng.sample(requests, args.limit)
    if args.prompts_only:
        for r in random.Random(1).sample(requests, min(12, len(requests))):
            log.info("%s [%s]\n%s", r["id"], r["sampling_name"], json.dumps(r["messages"], indent=1)[:700])
        return
    partial = args.partial or args.out.with_name(args.out.name.replace(".jsonl.gz", "") + ".partial.jsonl")
    generate(requests, partial, args.batch_size)
    count = finish(requests, partial, args.out)
    log.info("wrote %d requests to %s (%.1f kB); the progress file %s can be deleted",
             count, args.out, args.out.stat().st_size / 1024, partial)


if __name__ == "__main__":
    main()
