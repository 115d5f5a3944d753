"""A set of chat conversations of Kervan's own: the tests that hold greedy output to one
answer whatever the cache holds ask them (``tests/test_same_answer.py``), and the benchmark
of the quantized kernels' quality (``benchmarks/quant_activations.py``) compares answers on
them. Short questions, long ones, a system prompt now and then, and conversations of several
turns whose earlier answers are fixed text (as a chat client sends the history back). Each
item is the messages a chat template renders; the last is always the user's."""

from __future__ import annotations

SHORT = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
    "What is 12 times 7?", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
    "Give me a synonym for happy.", "How many legs does a spider have?", "What is photosynthesis?",
    "Translate 'good morning' into Spanish.", "What is the largest planet in our solar system?",
    "Name a famous painter.", "What does CPU stand for?", "List three prime numbers.",
    "What is the square root of 81?", "Why is the sky blue?", "What language is spoken in Brazil?",
    "Tell me a fun fact about octopuses.", "What is the opposite of cold?", "How do bees make honey?",
    "What year did the first person walk on the Moon?", "Suggest a name for a pet goldfish.",
    "What is a noun?", "Explain gravity in one sentence.", "What is the chemical symbol for gold?",
    "Write a short rhyme about a cat.", "How many days are in a leap year?", "What is the capital of Japan?",
]

LONG = [
    "I am planning a three-day trip to Rome in late autumn with my parents, who do not like long walks. "
    "We want to see the main sights, eat well, and rest in the afternoons. Could you sketch a gentle plan "
    "for each day, with one museum, one meal suggestion and one quiet place to sit?",
    "Here is a paragraph from my essay: 'Cities grow because people move to them for work, and work moves "
    "to them because people are there. This feedback loop explains why large cities keep growing even when "
    "they are expensive.' Please point out one weakness in the argument and suggest how to fix it.",
    "My Python function reads a large CSV file line by line, splits each line on commas, converts the third "
    "column to a float and sums it. It is slow on files of several gigabytes. What are three ways to make "
    "it faster, and which would you try first?",
    "Explain to a ten-year-old how a refrigerator keeps food cold, using an analogy with sweating on a hot "
    "day, and finish with one safety tip about opening the fridge door.",
    "A farmer has chickens and cows. Together they have 30 heads and 74 legs. How many chickens and how "
    "many cows are there? Show the steps of your reasoning.",
    "Compare trains and planes for a 600 kilometre journey in Europe, considering time door to door, cost, "
    "comfort and emissions. Which would you recommend for a family of four with luggage?",
    "Write the opening paragraph of a mystery story set in a lighthouse during a storm, in which the keeper "
    "finds a letter addressed to someone who died a hundred years ago.",
    "I keep forgetting to drink water during the work day. Give me five practical habits that could help, "
    "each in one sentence, and say which one is easiest to start with.",
    "What are the main differences between a virus and a bacterium? Mention size, how they reproduce, and "
    "whether antibiotics work against them.",
    "Summarise the water cycle in four steps, naming evaporation, condensation, precipitation and "
    "collection, and give an everyday example of each.",
]

SYSTEM = [
    ("You are a pirate who answers every question in pirate speech.", "Where is the treasure buried?"),
    ("You are a concise assistant. Answer in at most ten words.", "What is the speed of light?"),
    ("You are a friendly cooking teacher.", "How do I boil an egg so the yolk stays soft?"),
    ("You are a helpful math tutor who explains each step.", "What is 15 percent of 240?"),
]

MULTI_TURN = [
    [("What is the capital of France?", "The capital of France is Paris."),
     ("And what river flows through it?", None)],
    [("Name three primary colors.", "Red, blue and yellow."),
     ("Which two make green?", None)],
    [("I have a cat named Luna.", "Luna is a lovely name for a cat!"),
     ("What is my cat's name?", None)],
    [("What is 12 times 7?", "12 times 7 is 84."),
     ("Now add 16 to that.", "84 plus 16 is 100."),
     ("Divide the result by 4.", None)],
    [("Write a haiku about the sea.",
      "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
     ("Now write one about the mountains.", None)],
    [("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
     ("Name another play he wrote.", "He also wrote Hamlet."),
     ("What is Hamlet about?", None)],
    [("I want to learn a new language.", "That is a great goal! Which language interests you?"),
     ("Spanish, because I travel to Mexico often.", None)],
    [("What is photosynthesis?", "Photosynthesis is how plants turn light, water and carbon dioxide into sugar "
      "and oxygen."),
     ("Where in the plant does it happen?", None)],
    [("Suggest a name for a pet goldfish.", "How about Bubbles?"),
     ("Something more unusual, please.", "How about Captain Fin?"),
     ("Why that name?", None)],
    [("How many legs does a spider have?", "A spider has eight legs."),
     ("And an insect?", None)],
]


def conversations() -> list[list[dict[str, str]]]:
    """Every conversation of the set, in a fixed order: 52 of them."""
    out = [[{"role": "user", "content": q}] for q in SHORT + LONG]
    out += [[{"role": "system", "content": s}, {"role": "user", "content": q}] for s, q in SYSTEM]
    for turns in MULTI_TURN:
        messages = []
        for question, answer in turns:
            messages.append({"role": "user", "content": question})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        out.append(messages)
    return out
