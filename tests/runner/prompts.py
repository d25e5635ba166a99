"""Realistic chat prompts for exactness tests (rendered through the model's own template)."""

SYSTEM = (
    "You are Orion, a meticulous assistant for the Harbor Logistics company. Follow the operating rules. "
    + " ".join(
        f"Rule {i}: when a customer asks about shipment category {i}, confirm the tracking number, explain "
        f"the delivery window and never promise dates beyond warehouse estimate {i * 7}."
        for i in range(1, 3)
    )
)

QUESTIONS = [
    "Where is my parcel? It was supposed to arrive on Monday.",
    "What is the capital of France?",
    "Write a haiku about container ships.",
    "How do I reset my password?",
    "Explain rule 3 in simpler words.",
    "Can you list three tips for packing fragile items?",
    "My tracking number is HX-4471. What now?",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Summarise your rules in one sentence.",
    "Is category 5 shipping faster than category 2?",
    "Tell me a short joke about logistics.",
    "Who wrote Pride and Prejudice?",
    "Describe the colour blue to someone who cannot see.",
    "What should I do if my package arrives damaged?",
    "Give me a two-line poem about the sea.",
]


def chat_prompts(tokenizer, n: int = 16, with_system: bool = True) -> list[list[int]]:
    out = []
    for i, q in enumerate(QUESTIONS[:n]):
        msgs = [{"role": "user", "content": q}]
        if with_system:
            msgs.insert(0, {"role": "system", "content": SYSTEM})
        out.append(tokenizer.render_chat(msgs))
    return out
