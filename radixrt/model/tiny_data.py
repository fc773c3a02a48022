"""The tiny model's training text, made from the files in `radixrt/model/data`.

- Prose files (`PROSE_FILES`): sections that start with a `# Title` line, paragraphs split by
  blank lines. A block whose lines all start with `User: ` / `Assistant: ` / `System: ` is a
  chat, and is trained on in the chat template as well.
- `chats.txt`: hand-written chats in that `Role: content` form, one per block.
- `qa.txt`: `Q: ...` / `A: ...` line pairs, one per block, for few-shot documents.

`training_documents()` turns them into plain-text documents: each section once, as prose or
as a chat made from it (ask about the title, continue its first sentences, tell a story),
every chat in the chat template (what `CHAT_TEMPLATE` in tiny_tokenizer.py renders) and
few-shot Q/A blocks.
Everything is deterministic: choices come from one seeded `random.Random`.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from typing import NamedTuple

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
PROSE_FILES = ("corpus.txt", "prose.txt", "stories.txt")
STORY_FILE = "stories.txt"  # its sections also answer "tell me a story"
CHAT_FILE = "chats.txt"
QA_FILE = "qa.txt"
DATA_FILES = (*PROSE_FILES, CHAT_FILE, QA_FILE)

ROLES = {"System": "system", "User": "user", "Assistant": "assistant"}
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly and kindly.",
    "You are a friendly assistant who likes to explain things simply.",
    "Answer in plain English.",
)
ABOUT_QUESTIONS = (
    "Tell me about {title}.",
    "What can you tell me about {title}?",
    "Write a few sentences about {title}.",
    "I would like to read something about {title}.",
)
STORY_QUESTIONS = (
    "Tell me a story.",
    "Can you tell me a short story?",
    "Tell me a story about {title}.",
    "I am bored. Tell me a story, please.",
)
CONTINUE_QUESTIONS = (
    "Continue this: {text}",
    "What comes next? {text}",
    "Please carry on from here: {text}",
)
SENTENCE_END = re.compile(r'(?<=[.!?])\s+(?=[A-Z"])')


class Section(NamedTuple):
    title: str  # the `# Title` line without the "# "
    paragraphs: tuple[str, ...]  # blank-line separated blocks, stripped


Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}


def data_path(name: str) -> str:
    return os.path.join(DATA_DIR, name)


def data_sha256() -> str:
    """One hash over every data file (names and bytes): the training text's identity."""
    digest = hashlib.sha256()
    for name in DATA_FILES:
        with open(data_path(name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


def read_text(name: str) -> str:
    with open(data_path(name), encoding="utf-8") as f:
        return f.read()


def tokenizer_text() -> str:
    """All shipped text, for training the BPE."""
    return "\n\n".join(read_text(name) for name in DATA_FILES)


def read_sections(name: str) -> list[Section]:
    """Sections of a prose file; text before the first `# ` title is not allowed."""
    sections: list[Section] = []
    for chunk in re.split(r"^# ", read_text(name), flags=re.M)[1:]:
        title, _, body = chunk.partition("\n")
        paragraphs = tuple(p.strip("\n") for p in re.split(r"\n\s*\n", body) if p.strip())
        sections.append(Section(title.strip(), paragraphs))
    return sections


def parse_chat(block: str) -> list[Message] | None:
    """Messages of a `Role: content` block, or None if any line is not a chat line."""
    messages = []
    for line in block.strip().splitlines():
        role, sep, content = line.partition(": ")
        if not sep or role not in ROLES:
            return None
        messages.append({"role": ROLES[role], "content": content.strip()})
    return messages


def read_chats() -> list[list[Message]]:
    chats = []
    for block in re.split(r"\n\s*\n", read_text(CHAT_FILE)):
        if not block.strip():
            continue
        messages = parse_chat(block)
        if messages is None:
            raise ValueError(f"{CHAT_FILE}: not a chat block: {block[:80]!r}")
        chats.append(messages)
    return chats


def read_qa() -> list[tuple[str, str]]:
    pairs = []
    for block in re.split(r"\n\s*\n", read_text(QA_FILE)):
        lines = block.strip().splitlines()
        if not lines:
            continue
        if len(lines) != 2 or not lines[0].startswith("Q: ") or not lines[1].startswith("A: "):
            raise ValueError(f"{QA_FILE}: expected a 'Q: ' line and an 'A: ' line: {block!r}")
        pairs.append((lines[0][3:], lines[1][3:]))
    return pairs


def render_chat(messages: list[Message]) -> str:
    """The chat template of tiny.CHAT_TEMPLATE, without a generation prompt."""
    return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)


def render_few_shot(pairs: list[tuple[str, str]]) -> str:
    return "".join(f"Q: {q}\nA: {a}\n" for q, a in pairs)


def sentences(paragraph: str) -> list[str]:
    return SENTENCE_END.split(paragraph)


def is_prose(paragraph: str) -> bool:
    """One line of running text (not code, lists or a chat)."""
    return "\n" not in paragraph and paragraph[-1:] in '.!?"' and len(paragraph) > 80


def training_documents(seed: int = 0) -> list[str]:
    """Every training document (plain text, special tokens written out), shuffled by `seed`.

    Each section is used once: as prose, or (when all its paragraphs are prose) as a chat
    that asks about it or asks to continue it, then asks for more, one paragraph per turn.
    Stories are asked for as stories. Chat blocks inside sections are also used as chats.
    """
    rng = random.Random(seed)
    chats = read_chats()
    documents = []
    for name in PROSE_FILES:
        for section in read_sections(name):
            chats += [c for c in map(parse_chat, section.paragraphs) if c is not None]
            chat = _section_chat(section, rng, story=name == STORY_FILE)
            if chat is None:
                documents.append(f"{section.title}\n\n" + "\n\n".join(section.paragraphs))
            else:
                chats.append(chat)
    documents += [render_chat(c) for c in chats]
    qa = read_qa()
    for _ in range(len(qa) // 2):
        documents.append(render_few_shot(rng.sample(qa, rng.randint(3, 6))))
    rng.shuffle(documents)
    return documents


def _section_chat(section: Section, rng: random.Random, *, story: bool) -> list[Message] | None:
    """`section` as a chat, paragraph by paragraph; None: keep it as prose (half of the
    sections, and every section with a paragraph that is not prose)."""
    if not all(map(is_prose, section.paragraphs)) or rng.random() < 0.5:
        return None
    first, *rest = section.paragraphs
    title = section.title.lower()
    if story:
        question, more = rng.choice(STORY_QUESTIONS).format(title=title), "What happened next?"
        messages = [_user(question), _assistant(first)]
    elif rng.random() < 0.5:
        question, more = rng.choice(ABOUT_QUESTIONS).format(title=title), "Tell me more."
        messages = [_user(question), _assistant(first)]
    else:
        parts = sentences(first)
        cut = rng.randint(1, max(1, len(parts) - 1))
        text = " ".join(parts[:cut])
        question, more = rng.choice(CONTINUE_QUESTIONS).format(text=text), "Go on."
        messages = [_user(question), _assistant(" ".join(parts[cut:]) or first)]
    for paragraph in rest:
        messages += [_user(more), _assistant(paragraph)]
    return _with_system(rng, messages)


def _with_system(rng: random.Random, messages: list[Message]) -> list[Message]:
    if rng.random() < 0.5:
        return messages
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}, *messages]


def _user(content: str) -> Message:
    return {"role": "user", "content": content}


def _assistant(content: str) -> Message:
    return {"role": "assistant", "content": content}
