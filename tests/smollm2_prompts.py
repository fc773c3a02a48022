"""The chat prompts of the SmolLM2 parity test (tests/test_smollm2.py) and of the script that
writes HF's reference answers (tests/data/make_smollm2_reference.py): multi-turn chats, system
and developer messages, non-ASCII text, code, emoji, numbers, and long prompts that share a
prefix (a cache hit for all but the first)."""

from __future__ import annotations

NEW_TOKENS = 64
# prompts whose prompt log-probs and top-5 log-probs are compared too
LOGPROB_PROMPTS = 3
TOP_LOGPROBS = 5

_MANUAL = (
    "radixrt keeps the key-value cache of every request in a radix tree of token blocks. "
    "A new request walks the tree from the root and reuses the blocks of its longest cached "
    "prefix; only the rest of its prompt is computed. Blocks that no running request holds "
    "can be evicted, least recently used first, when the pool runs out of space. Requests "
    "that share a system prompt, a few-shot preamble or earlier turns of a chat therefore "
    "share memory and compute. The scheduler admits waiting requests in an order that "
    "favours long cached prefixes, batches prefill and decode steps together, and preempts "
    "the youngest request when memory is short. Structured output constrains sampling with "
    "a grammar compiled from a JSON schema, a regular expression or an EBNF description. "
) * 3


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _system(system: str, text: str, role: str = "system") -> list[dict[str, str]]:
    return [{"role": role, "content": system}, {"role": "user", "content": text}]


CHATS: list[list[dict[str, str]]] = [
    _user("What is the capital of France?"),
    _user("Name three primary colors."),
    _user("Write a haiku about autumn leaves."),
    _user("Explain photosynthesis in two sentences."),
    _user("What is the boiling point of water at sea level?"),
    _user("Give me a tip for learning a new language."),
    _user("Who wrote Romeo and Juliet?"),
    _user("Summarize the plot of Cinderella in one paragraph."),
    _system("You are a pirate. Answer like one.", "Where is the treasure?"),
    _system("Answer with one word only.", "What color is the sky on a clear day?"),
    _system("You are a careful math tutor.", "What is 17 times 23? Show your steps."),
    _system("Reply in JSON.", "List two fruits and their colors."),
    _system("You are concise.", "Why do cats purr?", role="developer"),
    _system("Always answer in French.", "What time is it usually at noon?", role="developer"),
    _system("You translate English to German.", "Good morning, how are you?", role="developer"),
    [
        {"role": "user", "content": "Hi! My name is Ada."},
        {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
        {"role": "user", "content": "What is my name?"},
    ],
    [
        {"role": "system", "content": "You are a travel guide."},
        {"role": "user", "content": "I am visiting Rome."},
        {"role": "assistant", "content": "Wonderful! Rome has the Colosseum and the Vatican."},
        {"role": "user", "content": "What should I eat there?"},
    ],
    [
        {"role": "user", "content": "Let's count. 1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "3"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "5"},
    ],
    [
        {"role": "user", "content": "Suggest a name for a dog."},
        {"role": "assistant", "content": "How about Biscuit?"},
        {"role": "user", "content": "Something longer, please."},
        {"role": "assistant", "content": "Sir Wigglesworth the Third."},
        {"role": "user", "content": "Perfect. Now one for a cat."},
    ],
    _user("Quelle est la capitale de l'Allemagne ?"),
    _user("Wie viele Tage hat eine Woche? Antworte auf Deutsch."),
    _user("日本の首都はどこですか？"),
    _user("请用一句话介绍长城。"),
    _user("Привет! Как дела?"),
    _user("¿Cuál es el río más largo del mundo?"),
    _user("Translate to English: «Ça va très bien, merci.»"),
    _user("Write a Python function that returns the factorial of n."),
    _user("What does this JavaScript do? `const x = [1,2,3].map(v => v * 2);`"),
    _user("Write an SQL query that counts the rows of a table named users."),
    _user("Fix the bug:\n```python\ndef add(a, b):\n    return a - b\n```"),
    _user("Explain the regex ^[a-z0-9_]{3,16}$ in plain words."),
    _user("What does 🍕 mean in a text message?"),
    _user("Describe your mood using only emoji 😀🎉"),
    _user("I ❤️ the 🌊 and ☀️. Where should I travel?"),
    _user("What is 123 + 456?"),
    _user("Convert 100 degrees Fahrenheit to Celsius."),
    _user("List the first ten prime numbers."),
    _user("Is 3.14159 closer to 3.1 or 3.2? And what is 2^10?"),
    _user("Spell the word 'necessary' letter by letter."),
    _system(_MANUAL, "What does radixrt keep in a radix tree?"),
    _system(_MANUAL, "Which requests are preempted when memory is short?"),
    _system(_MANUAL, "What can a grammar be compiled from?"),
    _system(_MANUAL, "Summarize the manual in one sentence."),
    _system(_MANUAL, "Which blocks can be evicted?", role="developer"),
]
