"""The generated encyclopedia behind SearchQA: fictional entities, passages, questions.

Search-R1 asks NQ and HotpotQA questions over Wikipedia; a model can answer many
of those from memory. Here every name is made up (syllables drawn from a seeded
`random.Random`), so an answer can only come from the passages: one short
encyclopedic passage per entity, stating that entity's own facts and nothing
about the entities that point to it (a passage about a person does not list the
books they wrote), so a 3-hop question needs three searches.

Entities: countries, cities, people, organisations and written works. Typed
relations link them (born in, member of, founded by, headquartered in, written
by, located in, capital of) or give a literal (birth year, occupation,
founding year, publication year). Questions follow one relation (easy) or a
chain of two or three (hard): "Where was the founder of the Orvane Guild born?"

Everything is a pure function of the seed (int seeds only, never `hash()`), so
the same seed builds the same world, questions and task ids on any machine.
Train and test questions ask about disjoint facts: each fact is assigned to one
split, and a question belongs to the split of the fact it finally asks about.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

from contrail.envs.searchqa.data import Hop, Passage, Question

# How many entities of each kind the world holds (about 2,900 passages).
COUNTS = {"country": 30, "city": 240, "person": 1500, "organisation": 400, "work": 700}
# How many questions each split holds per difficulty.
QUESTIONS_PER_SPLIT = {"train": 5000, "test": 1000}
TEST_FACT_SHARE = 0.2

LITERAL = "literal"


@dataclass(frozen=True)
class Relation:
    """A typed relation and every way the environment talks about it.

    ``phrase`` names the object from the subject ("the author of {s}") and exists
    only for entity-valued relations, the ones a multi-hop chain can pass through.
    ``statement`` is the fact as a sentence and ``need`` what is still unknown,
    both for the expert's thoughts; ``keyword`` is a word of the subject's passage
    that the expert adds to its query.
    """

    name: str
    subject: str
    obj: str
    questions: tuple[str, ...]
    statement: str
    need: str
    keyword: str
    phrase: str | None = None


RELATIONS: dict[str, Relation] = {
    relation.name: relation
    for relation in (
        Relation(
            "born_in", "person", "city",
            ("Where was {s} born?", "In which city was {s} born?", "What is the birthplace of {s}?"),
            "{s} was born in {o}", "where {s} was born", "born", "the birthplace of {s}",
        ),
        Relation(
            "birth_year", "person", LITERAL,
            ("In what year was {s} born?", "When was {s} born?"),
            "{s} was born in {o}", "when {s} was born", "born",
        ),
        Relation(
            "occupation", "person", LITERAL,
            ("What was the occupation of {s}?", "What did {s} work as?"),
            "{s} worked as {an_o}", "what {s} worked as", "born",
        ),
        Relation(
            "member_of", "person", "organisation",
            ("Which organisation did {s} belong to?", "Of which organisation was {s} a member?"),
            "{s} was a member of {o}", "which organisation {s} belonged to", "member",
            "the organisation that {s} belonged to",
        ),
        Relation(
            "founded_by", "organisation", "person",
            ("Who founded {s}?", "Who was the founder of {s}?"),
            "{s} was founded by {o}", "who founded {s}", "founded", "the founder of {s}",
        ),
        Relation(
            "founded_year", "organisation", LITERAL,
            ("In what year was {s} founded?", "When was {s} established?"),
            "{s} was founded in {o}", "when {s} was founded", "founded",
        ),
        Relation(
            "headquartered_in", "organisation", "city",
            ("In which city is {s} headquartered?", "Where is {s} based?"),
            "{s} is headquartered in {o}", "where {s} is headquartered", "headquartered",
            "the city where {s} is headquartered",
        ),
        Relation(
            "written_by", "work", "person",
            ("Who wrote {s}?", "Who is the author of {s}?"),
            "{s} was written by {o}", "who wrote {s}", "written", "the author of {s}",
        ),
        Relation(
            "published_year", "work", LITERAL,
            ("In what year was {s} first published?", "When was {s} first published?"),
            "{s} was first published in {o}", "when {s} was first published", "published",
        ),
        Relation(
            "located_in", "city", "country",
            ("In which country is {s}?", "In which country is {s} located?"),
            "{s} is in {o}", "which country {s} is in", "city", "the country where {s} is located",
        ),
        Relation(
            "capital", "country", "city",
            ("What is the capital of {s}?", "Which city is the capital of {s}?"),
            "the capital of {s} is {o}", "the capital of {s}", "capital", "the capital of {s}",
        ),
    )
}

# --- vocabulary for names and flavour text -----------------------------------------

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p",
           "qu", "r", "s", "sk", "st", "t", "th", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ae", "ei", "ia", "ou", "y")
_CODAS = ("", "", "l", "n", "r", "s", "th", "m", "nd", "rn", "sk", "x", "ll", "ss", "k", "t")
_CITY_SUFFIXES = ("", "", "", "", "holm", "mere", "ford", "wick", "stad", "gard", "moor")
_COUNTRY_SUFFIXES = ("ia", "land", "ora", "avia", "mark", "istan")
_STATE_FORMS = ("Republic", "Kingdom", "Grand Duchy", "Commonwealth", "Federation", "Principality")
_ORG_TYPES = ("Institute", "Guild", "Society", "Academy", "Trading Company", "Conservatory",
              "League", "Observatory", "Foundation", "Brotherhood", "Assembly", "Collegium")
_OCCUPATIONS = ("cartographer", "astronomer", "shipwright", "composer", "physician", "glassblower",
                "architect", "botanist", "engraver", "linguist", "alchemist", "clockmaker",
                "navigator", "sculptor", "magistrate", "weaver", "surveyor", "apothecary",
                "historian", "mathematician", "poet", "diplomat", "printer", "geologist")
_GENRES = ("novel", "play", "treatise", "epic poem", "memoir", "chronicle", "collection of essays", "travelogue")
_ADJECTIVES = ("Amber", "Silent", "Hollow", "Crimson", "Distant", "Gilded", "Broken", "Northern",
               "Winter", "Ashen", "Forgotten", "Iron", "Salt", "Velvet", "Burning", "Quiet",
               "Drowned", "Last", "Pale", "Wandering", "Hidden", "Copper", "Seventh", "Bitter")
_NOUNS = ("Lantern", "Harbour", "Orchard", "Compass", "Tower", "Meridian", "Garden", "Archive",
          "Bridge", "Tide", "Crown", "Mirror", "Voyage", "Bell", "Loom", "Citadel", "Feather",
          "River", "Ledger", "Chorus", "Key", "Atlas", "Furnace", "Vigil")
_PERSON_TRAITS = ("a meticulous survey of the eastern marshes", "several disputed theories about tides",
                  "an unfinished catalogue of comets", "a lifelong feud with the city council",
                  "teaching at a small provincial school", "restoring an old lighthouse",
                  "a famous collection of pressed flowers", "designing the first public clock of the region",
                  "a series of letters on the nature of light", "reforming the local weights and measures")
_ORG_PURPOSES = ("the preservation of old maps", "the study of river navigation", "training young engravers",
                 "funding expeditions to the northern ice", "the advancement of the mechanical arts",
                 "keeping the regional star charts", "the promotion of choral music",
                 "the regulation of the salt trade", "publishing translations of ancient texts")
_WORK_THEMES = ("a family of lighthouse keepers", "a failed expedition across the salt flats",
                "the founding of a mountain monastery", "two rival clockmakers", "a city slowly sinking into a lagoon",
                "a cartographer who maps a country that does not exist", "the last winter of an old empire",
                "a caravan of travelling musicians", "a forgotten war over a river ford")
_CITY_FEATURES = ("stone bridges", "annual lantern festival", "salt markets", "covered arcades",
                  "old observatory", "canal locks", "glassworks", "terraced vineyards", "fortified harbour",
                  "weaving mills", "cathedral bells", "mineral springs")
_COUNTRY_FEATURES = ("mountainous", "coastal", "landlocked", "densely forested", "arid", "lake-rich")
_CITY_SIZES = ("small", "large", "walled", "port", "market", "riverside", "hill")


def _with_article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


class _NameForge:
    """Made-up words from syllables; never the same word twice."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: tuple[int, int] = (2, 3), suffixes: tuple[str, ...] = ("",)) -> str:
        while True:
            count = self.rng.randint(*syllables)
            # Open syllables and one final coda keep names pronounceable ("Velomar").
            syllables_text = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(count))
            candidate = (syllables_text + self.rng.choice(_CODAS) + self.rng.choice(suffixes)).capitalize()
            if len(candidate) >= 5 and candidate.lower() not in self.used:
                self.used.add(candidate.lower())
                return candidate


@dataclass
class Entity:
    """One thing the encyclopedia has a passage about.

    ``mention`` is how a sentence names it mid-text ("the Orvane Guild");
    ``facts`` maps a relation name to an entity index or a literal string;
    ``flavour`` holds descriptive text that answers no question.
    """

    kind: str
    name: str
    mention: str
    aliases: tuple[str, ...]
    facts: dict[str, int | str] = field(default_factory=dict)
    flavour: dict[str, str] = field(default_factory=dict)


class World:
    """A seeded encyclopedia: entities, their passages and the questions over them."""

    def __init__(self, seed: int = 0) -> None:
        if not isinstance(seed, int):
            raise TypeError(f"SearchQA world seed must be an int, got {type(seed).__name__}")
        self.seed = seed
        self.entities: list[Entity] = []
        _populate(self, random.Random(seed))

    def of_kind(self, kind: str) -> list[int]:
        return [index for index, entity in enumerate(self.entities) if entity.kind == kind]

    # --- facts --------------------------------------------------------------------
    def value_text(self, relation: str, value: int | str) -> str:
        """The object of a fact as a sentence mentions it."""
        return self.entities[value].mention if RELATIONS[relation].obj != LITERAL else str(value)

    def answers(self, relation: str, value: int | str) -> tuple[str, ...]:
        """Gold answers for a fact's object: the name and its aliases."""
        if RELATIONS[relation].obj == LITERAL:
            return (str(value),)
        entity = self.entities[value]
        return (entity.name, *entity.aliases)

    def hop(self, subject: int, relation: str) -> Hop:
        value = self.entities[subject].facts[relation]
        return Hop(passage=subject, subject=self.entities[subject].mention, relation=relation,
                   obj=self.value_text(relation, value))

    # --- passages -----------------------------------------------------------------
    @cached_property
    def passages(self) -> list[Passage]:
        """One passage per entity, in entity order (passage i describes entity i)."""
        return [Passage(id=str(index), title=entity.name, text=_render(self, entity))
                for index, entity in enumerate(self.entities)]

    # --- questions ----------------------------------------------------------------
    @cached_property
    def fact_split(self) -> dict[tuple[int, str], str]:
        """Each fact's split: a question's split is that of the fact it finally asks."""
        rng = random.Random(self.seed * 1_000_003 + 1)
        return {
            (index, relation): ("test" if rng.random() < TEST_FACT_SHARE else "train")
            for index, entity in enumerate(self.entities)
            for relation in entity.facts
        }

    @cached_property
    def questions(self) -> list[Question]:
        """Every question, ordered train-easy, train-hard, test-easy, test-hard.

        A question's position in this list is its task id.
        """
        ordered = []
        for split in ("train", "test"):
            ordered += self._single_hop(split, QUESTIONS_PER_SPLIT[split])
            ordered += self._multi_hop(split, QUESTIONS_PER_SPLIT[split])
        return ordered

    def _question(self, chain: list[tuple[int, str]], split: str, rng: random.Random) -> Question:
        """Phrase a chain of (subject, relation) facts as one question."""
        subject = self.entities[chain[0][0]].mention
        for _, relation in chain[:-1]:
            subject = RELATIONS[relation].phrase.format(s=subject)
        last_subject, last_relation = chain[-1]
        template = rng.choice(RELATIONS[last_relation].questions)
        return Question(
            text=template.format(s=subject),
            answers=self.answers(last_relation, self.entities[last_subject].facts[last_relation]),
            split=split,
            difficulty="easy" if len(chain) == 1 else "hard",
            hops=tuple(self.hop(index, relation) for index, relation in chain),
        )

    def _single_hop(self, split: str, count: int) -> list[Question]:
        rng = random.Random(self.seed * 1_000_003 + (2 if split == "train" else 3))
        facts = [fact for fact, fact_split in self.fact_split.items() if fact_split == split]
        rng.shuffle(facts)
        return [self._question([fact], split, rng) for fact in facts[:count]]

    def _multi_hop(self, split: str, count: int) -> list[Question]:
        rng = random.Random(self.seed * 1_000_003 + (4 if split == "train" else 5))
        starts = [index for index, entity in enumerate(self.entities)
                  if any(RELATIONS[name].phrase for name in entity.facts)]
        seen: set[tuple] = set()
        questions: list[Question] = []
        for _ in range(count * 50):  # bounded: a tiny world may hold fewer chains than asked
            if len(questions) == count:
                break
            chain = self._random_chain(rng.choice(starts), rng.choice((2, 3)), rng)
            if chain is None or tuple(chain) in seen or self.fact_split[chain[-1]] != split:
                continue
            seen.add(tuple(chain))
            questions.append(self._question(chain, split, rng))
        return questions

    def _random_chain(self, start: int, hops: int, rng: random.Random) -> list[tuple[int, str]] | None:
        """A walk of ``hops`` facts through distinct entities, or None when it loops."""
        chain, visited, current = [], {start}, start
        for step in range(hops):
            names = sorted(self.entities[current].facts)
            if step < hops - 1:  # inner hops must lead to another entity
                names = [name for name in names if RELATIONS[name].phrase]
            if not names:
                return None
            relation = rng.choice(names)
            chain.append((current, relation))
            value = self.entities[current].facts[relation]
            if RELATIONS[relation].obj == LITERAL:
                break
            if value in visited:
                return None
            visited.add(value)
            current = value
        return chain if len(chain) == hops else None


# --- building the world -----------------------------------------------------------------


def _add(world: World, entity: Entity) -> int:
    world.entities.append(entity)
    return len(world.entities) - 1


def _populate(world: World, rng: random.Random) -> None:
    forge = _NameForge(rng)
    countries = [_add(world, _country(forge, rng)) for _ in range(COUNTS["country"])]
    cities = []
    for number in range(COUNTS["city"]):
        # Round-robin first, so every country has cities to pick a capital from.
        country = countries[number] if number < len(countries) else rng.choice(countries)
        name = forge.word(suffixes=_CITY_SUFFIXES)
        cities.append(_add(world, Entity(
            "city", name, name, (), {"located_in": country},
            {"size": rng.choice(_CITY_SIZES), "feature": rng.choice(_CITY_FEATURES)},
        )))
    for country in countries:
        world.entities[country].facts["capital"] = rng.choice(
            [city for city in cities if world.entities[city].facts["located_in"] == country])
    people = [_add(world, _person(forge, rng, cities)) for _ in range(COUNTS["person"])]
    organisations = [_add(world, _organisation(world, forge, rng, people, cities))
                     for _ in range(COUNTS["organisation"])]
    _drop_ambiguous_aliases(world, organisations)
    for person in people:
        world.entities[person].facts["member_of"] = rng.choice(organisations)
    titles: set[str] = set()
    for _ in range(COUNTS["work"]):
        _add(world, _work(world, forge, rng, people, titles))


def _country(forge: _NameForge, rng: random.Random) -> Entity:
    name = forge.word(syllables=(1, 2), suffixes=_COUNTRY_SUFFIXES)
    official = f"{rng.choice(_STATE_FORMS)} of {name}"
    return Entity("country", name, name, (official,), {}, {"feature": rng.choice(_COUNTRY_FEATURES),
                                                          "official": official})


def _person(forge: _NameForge, rng: random.Random, cities: list[int]) -> Entity:
    name = f"{forge.word(syllables=(1, 2))} {forge.word()}"
    return Entity(
        "person", name, name, (),
        {"born_in": rng.choice(cities), "birth_year": str(rng.randint(1580, 1880)),
         "occupation": rng.choice(_OCCUPATIONS)},
        {"trait": rng.choice(_PERSON_TRAITS), "surname": name.split()[-1]},
    )


def _organisation(world: World, forge: _NameForge, rng: random.Random,
                  people: list[int], cities: list[int]) -> Entity:
    name = f"{forge.word()} {rng.choice(_ORG_TYPES)}"
    founder = rng.choice(people)
    born = int(world.entities[founder].facts["birth_year"])
    acronym = "".join(word[0] for word in name.split())
    return Entity(
        "organisation", name, f"the {name}", (acronym,),
        {"founded_by": founder, "founded_year": str(born + rng.randint(20, 60)),
         "headquartered_in": rng.choice(cities)},
        {"purpose": rng.choice(_ORG_PURPOSES)},
    )


def _drop_ambiguous_aliases(world: World, organisations: list[int]) -> None:
    """Keep an acronym as an answer alias only when one organisation has it."""
    counts = Counter(alias for index in organisations for alias in world.entities[index].aliases)
    for index in organisations:
        entity = world.entities[index]
        entity.aliases = tuple(alias for alias in entity.aliases if counts[alias] == 1)


def _work(world: World, forge: _NameForge, rng: random.Random, people: list[int], titles: set[str]) -> Entity:
    while True:
        pattern = rng.randrange(4)
        adjective, noun = rng.choice(_ADJECTIVES), rng.choice(_NOUNS)
        if pattern == 0:
            title = f"The {adjective} {noun}"
        elif pattern == 1:
            title = f"The {noun} of {forge.word()}"
        elif pattern == 2:
            title = f"{adjective} {noun}s of {forge.word(syllables=(1, 2))}"
        else:
            title = f"{forge.word()}'s {noun}"
        if title.lower() not in titles:
            titles.add(title.lower())
            break
    author = rng.choice(people)
    born = int(world.entities[author].facts["birth_year"])
    return Entity(
        "work", title, title, (),
        {"written_by": author, "published_year": str(born + rng.randint(18, 70))},
        {"genre": rng.choice(_GENRES), "theme": rng.choice(_WORK_THEMES)},
    )


# --- rendering passages ------------------------------------------------------------------


def _render(world: World, entity: Entity) -> str:
    """The passage text: the entity's own facts in a few encyclopedic sentences."""
    facts, flavour = entity.facts, entity.flavour
    mention = _capitalised(entity.mention)

    def name_of(relation: str) -> str:
        return world.value_text(relation, facts[relation])

    if entity.kind == "country":
        return (f"{mention}, officially the {flavour['official']}, is {_with_article(flavour['feature'])} country. "
                f"Its capital is {name_of('capital')}.")
    if entity.kind == "city":
        return (f"{mention} is {_with_article(flavour['size'])} city in {name_of('located_in')}, "
                f"known for its {flavour['feature']}.")
    if entity.kind == "person":
        return (f"{mention} was {_with_article(facts['occupation'])} born in {name_of('born_in')} "
                f"in {facts['birth_year']}. A member of {name_of('member_of')}, {flavour['surname']} "
                f"is remembered for {flavour['trait']}.")
    if entity.kind == "organisation":
        aliases = f" ({entity.aliases[0]})" if entity.aliases else ""
        return (f"{mention}{aliases} is a body devoted to {flavour['purpose']}. It was founded in "
                f"{facts['founded_year']} by {name_of('founded_by')} and is headquartered in "
                f"{name_of('headquartered_in')}.")
    return (f"{mention} is {_with_article(flavour['genre'])} written by {name_of('written_by')}, "
            f"first published in {facts['published_year']}. It tells of {flavour['theme']}.")
