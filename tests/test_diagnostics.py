"""Each failure tag on hand-written conversations: one that shows it and one that does not."""

import pytest

from contrail.diagnostics import TAGS, count_tags, model_turns, tags, turn_validity

INSTRUCTION = "You are an agent. Example: go to red ball 1, get 1 lapis lazuli."


def convo(env, first, turns, *, success=False, invalid=None, truncated=False, error=None, split="test",
          flags=None):
    """A record: instruction, acknowledgement, first observation, then (model text, observation) pairs.

    The last pair's observation may be None (the rollout records none after the final turn).
    """
    messages = [{"role": "user", "content": INSTRUCTION}, {"role": "assistant", "content": "OK."},
                {"role": "user", "content": first}]
    for i, (text, observation) in enumerate(turns):
        message = {"role": "assistant", "content": text}
        if flags is not None:
            message["valid"] = flags[i]
        messages.append(message)
        if observation is not None:
            messages.append({"role": "user", "content": observation})
    if error:
        messages.append({"role": "error", "content": "Traceback ..."})
    return {"task": {"env": env, "id": 7, "split": split, "difficulty": "easy"}, "sample": 0,
            "reward": float(success), "success": success, "turns": len(turns), "generated_tokens": 10,
            "invalid_actions": invalid if invalid is not None else 0, "truncated": truncated, "error": error,
            "messages": messages}


def act(action, thought="I think so."):
    return f"Thought:\n{thought}\n\nAction:\n{action}"


BABY_MENU = ('Available actions: ["turn left", "turn right", "move forward", "go to red ball 1", '
             '"check available actions"]')
BABY_OBS = f"There is a red ball 1 2 steps in front of you. You are not carrying anything.\n{BABY_MENU}"
BABY_ERROR = f"The action is not recognized. Please check valid actions.\n{BABY_MENU}"


def test_turns_skip_the_acknowledgement_and_pair_observations():
    record = convo("babyai", "Your goal: go to the red ball\n" + BABY_OBS,
                   [(act("turn left"), BABY_OBS), (act("go to red ball 1"), None)])
    turns, observations = model_turns(record)
    assert [t.text.splitlines()[-1] for t in turns] == ["turn left", "go to red ball 1"]
    assert turns[1].before == BABY_OBS and turns[1].after is None and turns[1].shown == 2
    assert len(observations) == 2


def test_invalid_streak_babyai_by_the_action_list():
    bad = [(act("fly away"), BABY_ERROR)] * 3 + [(act("turn left"), None)]
    record = convo("babyai", BABY_OBS, bad, invalid=3)
    assert turn_validity(record) == [False, False, False, True]
    assert "invalid_streak" in tags(record)
    broken = [(act("fly away"), BABY_ERROR), (act("fly away"), BABY_ERROR), (act("turn left"), BABY_OBS),
              (act("fly away"), None)]
    assert "invalid_streak" not in tags(convo("babyai", BABY_OBS, broken, invalid=3))
    # two Action lines are invalid even when both are listed
    two = "Action: turn left\nAction: turn right"
    assert turn_validity(convo("babyai", BABY_OBS, [(two, None)], invalid=1)) == [False]


def test_invalid_by_environment_messages_and_by_flags():
    alf = convo("alfworld", "You are in the middle of a room. you see a fridge 1.",
                [(act("go to moon 1"), "Nothing happened.")] * 3 + [(act("go to fridge 1"), "The fridge 1 is closed.")])
    assert turn_validity(alf) == [False, False, False, True] and "invalid_streak" in tags(alf)
    craft = convo("textcraft", "Crafting commands:\ncraft 1 stick using 2 oak planks\n\nGoal: craft stick.",
                  [(act("get 2 oak planks"), "Could not find oak planks"),
                   (act("craft stick"), "Wrong item format: stick"),
                   (act("get 1 oak logs"), "Got 1 oak logs")])
    assert turn_validity(craft) == [False, False, True]
    qa = convo("searchqa", "Question: who?", [("<think>hm</think>", "My previous action is invalid. ...")] * 2
               + [("<answer> </answer>", None)], invalid=3)
    assert turn_validity(qa) == [False, False, False] and "invalid_streak" in tags(qa)
    # the rollout's own flags win over any rule; unknown envs fall back on the count
    flagged = convo("alfworld", "room", [(act("look"), "Nothing happened.")] * 3, flags=[True, True, True])
    assert turn_validity(flagged) == [True, True, True]
    other = convo("mystery", "obs", [("x", "y"), ("x", "y"), ("x", None)], invalid=3)
    assert turn_validity(other) == [False, False, False]
    assert turn_validity(convo("mystery", "obs", [("x", "y"), ("x", None)], invalid=1)) == [None, None]


def test_loop_needs_the_same_action_and_an_unchanged_observation():
    looping = [(act("move forward"), "There is a barrier.")] * 3
    assert "loop" in tags(convo("babyai", BABY_OBS, looping))
    moving = [(act("move forward"), "view 1"), (act("move forward"), "view 2"), (act("move forward"), "view 3")]
    assert "loop" not in tags(convo("babyai", BABY_OBS, moving))
    short = [(act("move forward"), "There is a barrier.")] * 2
    assert "loop" not in tags(convo("babyai", BABY_OBS, short))


def test_searchqa_answers_without_search_and_unsupported():
    guess = convo("searchqa", "Question: Who founded Vell?",
                  [("<think>I know</think><answer> Ada Moro </answer>", None)])
    assert tags(guess) == ["answer_without_search"]
    info = "<information>Doc 1(Title: Vell) Vell was founded by Ada Moro in 1820.\n</information>"
    supported = convo("searchqa", "Question: Who founded Vell?",
                      [("<search> Vell founder </search>", info), ("<answer> ada moro </answer>", None)], success=True)
    assert tags(supported) == []
    unsupported = convo("searchqa", "Question: Who founded Vell?",
                        [("<search> Vell founder </search>", info), ("<answer> Bo Lind </answer>", None)])
    assert tags(unsupported) == ["unsupported_answer"]


GOAL = "i need a blue mug with handle, and size: large, and price lower than 30.00 dollars"
SEARCH = f"WebShop [SEP] Instruction: [SEP] {GOAL} [SEP] Search"
HEAD = f"Instruction: [SEP] {GOAL} [SEP] Back to Search"
RESULTS = (f"{HEAD} [SEP] Page 1 (Total results: 2) [SEP] B01 [SEP] Blue mug [SEP] $12.00 "
           "[SEP] B02 [SEP] Red mug [SEP] $9.00")
ITEM = (f"{HEAD} [SEP] < Prev [SEP] size [SEP] small [SEP] large [SEP] Blue mug [SEP] Price: $12.00 [SEP] "
        "Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now")


def test_webshop_buy_without_the_goals_options():
    hasty = convo("webshop", SEARCH, [("Action:\nsearch[blue mug]", RESULTS), ("Action:\nclick[B01]", ITEM),
                                      ("Action:\nclick[Buy Now]", None)])
    assert tags(hasty) == ["buy_without_options"]
    careful = convo("webshop", SEARCH, [("Action:\nsearch[blue mug]", RESULTS), ("Action:\nclick[B01]", ITEM),
                                        ("Action:\nclick[large]", ITEM), ("Action:\nclick[Buy Now]", None)],
                    success=True)
    assert tags(careful) == []
    assert turn_validity(careful) == [True, True, True, True]
    # options chosen on another product do not count for this one
    switched = convo("webshop", SEARCH, [("Action:\nsearch[blue mug]", RESULTS), ("Action:\nclick[B02]", ITEM),
                                         ("Action:\nclick[large]", ITEM), ("Action:\nclick[< Prev]", RESULTS),
                                         ("Action:\nclick[B01]", ITEM), ("Action:\nclick[Buy Now]", None)])
    assert "buy_without_options" in tags(switched)
    invalid = convo("webshop", SEARCH, [("Action:\nclick[B01]", SEARCH), ("Action:\nsearch[mug]", None)], invalid=1)
    assert turn_validity(invalid) == [False, True]


def test_fabrication_per_environment():
    baby = convo("babyai", BABY_OBS, [(act("go to purple key 1"), BABY_ERROR)])
    assert "fabrication" in tags(baby)
    assert "fabrication" not in tags(convo("babyai", BABY_OBS, [(act("go to red ball 1"), None)]))
    room = "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, and a fridge 1."
    alf = convo("alfworld", room, [(act("take apple 1 from fridge 1"), "Nothing happened.")])
    assert "fabrication" in tags(alf)
    seen = convo("alfworld", room, [(act("open fridge 1"), "You open the fridge 1. In it, you see a apple 1."),
                                    (act("take apple 1 from fridge 1"), None)])
    assert "fabrication" not in tags(seen)
    recipes = "Crafting commands:\ncraft 4 oak planks using 1 oak logs\n\nGoal: craft oak planks."
    # the instruction's example item (lapis lazuli) is no observation
    example = convo("textcraft", recipes, [(act("get 1 lapis lazuli"), "Could not find lapis lazuli")])
    assert "fabrication" in tags(example)
    fine = convo("textcraft", recipes, [(act("get 1 oak log"), "Got 1 oak log"),
                                        (act("craft 4 oak planks using 1 oak logs"), None)], success=True)
    assert "fabrication" not in tags(fine)
    shop = convo("webshop", SEARCH, [("Action:\nsearch[mug]", RESULTS), ("Action:\nclick[B99]", RESULTS)])
    assert "fabrication" in tags(shop)
    assert "fabrication" not in tags(convo("webshop", SEARCH, [("Action:\nsearch[mug]", RESULTS),
                                                               ("Action:\nclick[b02]", None)]))


def test_out_of_turns_truncation_and_errors():
    twenty = [(act("turn left"), BABY_OBS)] * 19 + [(act("turn left"), None)]
    assert "out_of_turns" in tags(convo("babyai", BABY_OBS, twenty))
    assert "out_of_turns" not in tags(convo("babyai", BABY_OBS, twenty[:5]))
    assert "out_of_turns" in tags(convo("babyai", BABY_OBS, twenty[:5]), turn_limit=5)
    assert "out_of_turns" not in tags(convo("babyai", BABY_OBS, twenty, success=True))
    # SearchQA's train tasks have 5 turns
    five = [("<search> x </search>", "<information></information>")] * 5
    assert "out_of_turns" in tags(convo("searchqa", "Question: q?", five, split="train"))
    assert "out_of_turns" not in tags(convo("searchqa", "Question: q?", five))
    # a WebShop purchase on the last turn ended the episode by choice
    ten = [("Action:\nclick[x]", SEARCH)] * 9 + [("Action:\nclick[Buy Now]", None)]
    assert "out_of_turns" not in tags(convo("webshop", SEARCH, ten))
    varied = [(act("turn left"), "view 1"), (act("turn right"), "view 2"), (act("move forward"), None)]
    assert tags(convo("babyai", BABY_OBS, varied, truncated=True)) == ["truncated"]
    assert tags(convo("babyai", BABY_OBS, varied)) == []
    broken = convo("babyai", BABY_OBS, twenty[:1], error="RuntimeError: engine died")
    assert tags(broken) == ["env_error"]


def test_count_tags_lists_every_tag():
    records = [convo("babyai", BABY_OBS, [(act("turn left"), None)], truncated=True),
               convo("babyai", BABY_OBS, [(act("turn left"), None)], truncated=True),
               convo("babyai", BABY_OBS, [(act("turn left"), None)])]
    counts = count_tags(records)
    assert list(counts) == list(TAGS) and counts["truncated"] == 2 and sum(counts.values()) == 2


def test_malformed_records_do_not_raise():
    assert tags({"task": {"env": "babyai"}, "messages": []}) == []
    assert tags({"task": {"env": "webshop"}, "turns": 1, "messages": [{"role": "assistant", "content": "x"}]}) == []


# --- the rules against the real environments' own validity ---------------------------------

GARBAGE = ["Thought: hmm\nAction: fly to the moon", "I do not know.", "Action: go to purple unicorn 9",
           "Action:\nclick[Nonexistent Thing]", "<answer> </answer>", "Action: get 3 unobtainium"]


def _play(env, task, rng, mode, limit=10):
    """One episode recorded as the rollout records it, with the environment's Step.valid per turn."""
    messages = env.prompt_messages() + [{"role": "user", "content": env.reset(task)}]
    truth, last = [], None
    while True:
        r = rng.random()
        if mode == "expert" or (mode == "mix" and r < 0.4):
            text = env.expert()
        elif mode == "random" or r < 0.75:
            text = env.random_action(rng)
        else:
            text = last if r < 0.85 and last else rng.choice(GARBAGE)
        last = text
        messages.append({"role": "assistant", "content": text})
        step = env.step(text)
        truth.append(step.valid)
        if step.done or len(truth) >= limit:
            break
        messages.append({"role": "user", "content": step.observation})
    record = {"task": task.to_dict(), "turns": len(truth), "invalid_actions": truth.count(False),
              "success": step.success, "reward": step.reward, "truncated": False, "error": None, "messages": messages}
    return record, truth


@pytest.mark.parametrize("name", ["babyai", "textcraft", "webshop", "searchqa"])
def test_validity_rules_agree_with_the_environments(name):
    import random

    from contrail import envs

    env = envs.make(name)
    rng = random.Random(0)
    try:
        for mode in ("mix", "expert"):
            for task in env.tasks("test")[:8]:
                record, truth = _play(env, task, rng, mode)
                assert turn_validity(record) == truth, (mode, task)
                if mode == "expert":  # the expert neither fabricates nor repeats invalid actions
                    assert not {"fabrication", "invalid_streak", "answer_without_search", "unsupported_answer",
                                "buy_without_options"} & set(tags(record, turn_limit=10)), (task, tags(record))
    finally:
        env.close()
