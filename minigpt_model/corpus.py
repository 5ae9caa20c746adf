"""The built-in corpus: simple children's stories from a small grammar, deterministic from a seed.

Enough variety (names, animals, places, objects, problems, helpers, endings) that a small
model has something to learn, and no download: `minigpt train` works on a bare machine.
"""

from __future__ import annotations

import random

from minigpt_model.tokenizer import END_OF_TEXT

NAMES = [
    "Lily",
    "Tom",
    "Mia",
    "Ben",
    "Sam",
    "Anna",
    "Max",
    "Zoe",
    "Leo",
    "Ella",
    "Jack",
    "Lucy",
    "Finn",
    "Rosa",
    "Timmy",
    "Sara",
    "Oscar",
    "Ivy",
    "Noah",
    "Daisy",
    "Hugo",
    "Nina",
    "Pip",
    "Molly",
    "Theo",
    "Ruby",
    "Kai",
    "Lola",
    "Otto",
    "Bella",
]
ANIMALS = [
    "cat",
    "dog",
    "bunny",
    "bear",
    "fox",
    "duck",
    "mouse",
    "bird",
    "frog",
    "pig",
    "owl",
    "lamb",
    "turtle",
    "squirrel",
    "puppy",
    "kitten",
    "hen",
    "goat",
]
ADJECTIVES = [
    "little",
    "happy",
    "brave",
    "shy",
    "curious",
    "kind",
    "silly",
    "small",
    "gentle",
    "clever",
    "sleepy",
    "busy",
    "friendly",
    "tiny",
    "proud",
]
PLACES = [
    ("a small house", "the big tree"),
    ("a quiet forest", "the river"),
    ("a sunny farm", "the red barn"),
    ("a busy town", "the old bridge"),
    ("a green park", "the pond"),
    ("a cozy village", "the hill"),
    ("a sandy beach", "the sea"),
    ("a big garden", "the flowers"),
    ("a snowy valley", "the mountain"),
]
ACTIVITIES = [
    "play with a ball",
    "run in the grass",
    "look at the clouds",
    "sing songs",
    "pick flowers",
    "build towers of sand",
    "jump in puddles",
    "read books",
    "draw pictures",
    "climb trees",
    "watch the birds",
    "splash in the water",
    "bake cookies with mom",
    "dance in the sun",
]
OBJECTS = [
    ("shiny", "stone"),
    ("red", "ball"),
    ("old", "key"),
    ("blue", "hat"),
    ("soft", "feather"),
    ("golden", "coin"),
    ("big", "box"),
    ("yellow", "kite"),
    ("funny", "map"),
    ("little", "boat"),
    ("pretty", "shell"),
    ("green", "leaf"),
    ("magic", "stick"),
    ("warm", "blanket"),
]
WHERE = [
    "under a rock",
    "near the water",
    "in the tall grass",
    "behind the house",
    "on a branch",
    "next to the path",
    "in an old box",
    "by the fence",
]
PROBLEMS = [
    ("the wind took the {obj} high into a tree", "climbed up and got it back"),
    ("the {obj} fell into the water", "used a long stick to pull it out"),
    ("a big dog barked and {name} dropped the {obj}", "looked everywhere until they found it"),
    ("it started to rain and the {obj} got wet", "dried it by the warm fire"),
    ("{name} could not find the way home", "followed the river back to the house"),
    ("the {obj} was stuck in the mud", "pulled together until it came free"),
    ("{name} and a friend both wanted the {obj}", "decided to share it and take turns"),
    ("the {obj} broke into two pieces", "fixed it with some glue and a lot of care"),
]
FEELINGS_BAD = ["sad", "scared", "worried", "upset", "angry"]
FEELINGS_GOOD = ["happy", "proud", "glad", "excited", "thankful"]
MORALS = [
    "it is good to share",
    "friends help each other",
    "being brave is important",
    "you should always say thank you",
    "it is good to be kind",
    "patience helps you",
    "asking for help is a smart thing to do",
    "working together makes things easier",
]
ENDINGS = [
    "From that day on, {name} and {friend} were best friends.",
    "That night, {name} slept with a big smile.",
    "{name} kept the {obj} in a safe place forever.",
    "Every day after that, they played together by {feature}.",
    "{name} went home and told mom all about the day.",
]


def story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    animal, friend_animal = rng.choice(ANIMALS), rng.choice(ANIMALS)
    home, feature = rng.choice(PLACES)
    color, thing = rng.choice(OBJECTS)
    obj = f"{color} {thing}"
    problem, fix = rng.choice(PROBLEMS)
    pronoun = rng.choice(["he", "she"])
    fill = dict(name=name, friend=friend, obj=obj, feature=feature)
    opening = rng.choice(["Once upon a time", "One day", "Long ago", "Once upon a time"])
    lines = [
        f"{opening}, there was a {rng.choice(ADJECTIVES)} {animal} named {name}.",
        f"{name} lived in {home} near {feature}.",
        f"Every day, {pronoun} liked to {rng.choice(ACTIVITIES)}.",
        f"One morning, {name} found a {obj} {rng.choice(WHERE)}.",
        f"{name} was very {rng.choice(FEELINGS_GOOD)} and wanted to show it to everyone.",
        f"But then, {problem.format(**fill)}.",
        f"{name} felt {rng.choice(FEELINGS_BAD)}.",
        f"{friend}, a {rng.choice(ADJECTIVES)} {friend_animal}, came to help.",
        f"Together, they {fix}.",
        f'{name} said, "Thank you, {friend}!"',
        rng.choice(ENDINGS).format(**fill),
    ]
    if rng.random() < 0.6:
        lines.append(f"{name} learned that {rng.choice(MORALS)}.")
    return " ".join(lines)


def default_corpus(*, stories: int = 12000, seed: int = 0) -> str:
    """About 7 MB of stories separated by <|endoftext|>, the same for the same seed."""
    rng = random.Random(seed)
    return END_OF_TEXT.join(story(rng) for _ in range(stories)) + END_OF_TEXT
