"""Realistic wrong diagnoses for lab 6, one slip each (importable: the checks run them on spawned
ranks), and correct alternatives that must pass. A wrong cause gets the hint naming what the
data shows; the right cause with a fix that leaves the symptom gets the rerun's numbers."""


# -- case a: stage 3 above ZeRO-2, the whole model one unit -------------------------------------
def a_blames_activations():
    return "activations", {"checkpointing": True}


def a_blames_collectives():
    return "too_many_collectives", {"units": "blocks"}


def a_drops_to_zero2():  # the symptom's name, not its cause: the run must stay at stage 3
    return "unit_gathered_whole", {"stage": 2}


def a_checkpoints_instead():  # lowers both peaks; stage 3 stays above ZeRO-2
    return "unit_gathered_whole", {"checkpointing": True}


def a_keeps_the_weights_gathered():  # the one unit is still gathered whole, and now kept for backward
    return "unit_gathered_whole", {"reshard_after_forward": False}


def a_changes_nothing():
    return "unit_gathered_whole", {"units": "whole"}


def a_invents_a_cause():
    return "communication_buffers", {"units": "blocks"}


def a_returns_a_list():  # correct: the two things in a list, not a tuple
    return ["unit_gathered_whole", {"units": "blocks"}]


def a_blames_weights_kept_gathered():  # a distractor: the plan keeps reshard_after_forward=True
    return "weights_kept_gathered", {"reshard_after_forward": True}


# -- case b: the same peak at 2 ranks and at 4 --------------------------------------------------
def b_blames_the_unit():
    return "unit_gathered_whole", {"units": "blocks"}


def b_blames_the_estimate():
    return "states_only_estimate", {"checkpointing": True}


def b_blames_collectives():
    return "too_many_collectives", {"units": "whole"}


def b_changes_the_stage():
    return "activations", {"stage": 2}


def b_changes_two_settings():
    return "activations", {"checkpointing": True, "batch_size": 8}


def b_halves_the_batch():  # the activations halve, the rest stays: the peak stays above half
    return "activations", {"batch_size": 16}


def b_smaller_micro_batch():  # correct: a quarter of the batch per rank (accumulate to keep the global batch)
    return "activations", {"batch_size": 8}


# -- case c: slower than DDP, one unit per nn.Linear --------------------------------------------
def c_blames_the_unit():
    return "unit_gathered_whole", {"units": "blocks"}


def c_blames_activations():
    return "activations", {"checkpointing": True}


def c_one_unit():  # correct: the model fits, so one unit of it, gathered once (the solution takes blocks)
    return "too_many_collectives", {"units": "whole"}


def c_turns_prefetch_off():
    return "too_many_collectives", {"prefetch": False}


def c_returns_the_cause_only():
    return "too_many_collectives"


def c_blames_prefetch():  # a distractor: the plan keeps prefetch=True
    return "gathers_not_overlapped", {"prefetch": True}


def c_ddp_on_the_same_units():  # the model fits, but DDP on 18 units is 18 small all-reduces
    return "too_many_collectives", {"stage": 0}


def c_zero2_on_the_same_units():  # 2Ψ like DDP by the ring formula, still 18 units and 36 collectives
    return "too_many_collectives", {"stage": 2}


def c_keeps_weights_gathered():  # skips the backward gathers, still 18 units
    return "too_many_collectives", {"reshard_after_forward": False}


# -- case d: no_sync keeps a whole gradient -----------------------------------------------------
def d_blames_activations():
    return "activations", {"checkpointing": True}


def d_blames_collectives():
    return "too_many_collectives", {"units": "whole"}


def d_blames_weights_kept_gathered():  # 4 bytes per parameter, as full weights would be: but it is gradient
    return "weights_kept_gathered", {"reshard_after_forward": True}


def d_changes_the_stage():  # ZeRO-2 under no_sync keeps the whole gradient too
    return "unreduced_gradient", {"stage": 2}


def d_keeps_no_sync():
    return "unreduced_gradient", {"sync_every_micro_batch": False}


def d_yes_for_a_bool():  # truthy, but not the setting's type
    return "unreduced_gradient", {"sync_every_micro_batch": "yes"}


def d_bad_units():
    return "unreduced_gradient", {"units": "leaves"}


A, B, C, D = "lab6.case_a", "lab6.case_b", "lab6.case_c", "lab6.case_d"
WRONG = {  # case: (task, wrong answer, the mistake the check must name, words its hint must contain)
    "a: blames activations": (A, a_blames_activations, "wrong_cause", "the same activations at stage 3 and at ZeRO-2"),
    "a: blames collectives": (A, a_blames_collectives, "wrong_cause", "a single unit"),
    "a: drops to ZeRO-2": (A, a_drops_to_zero2, "symptom_remains", "gives up sharding the weights"),
    "a: checkpoints instead": (A, a_checkpoints_instead, "symptom_remains", "still not below ZeRO-2's"),
    "a: keeps the weights gathered": (A, a_keeps_the_weights_gathered, "symptom_remains", "still not below ZeRO-2's"),
    "a: changes nothing": (A, a_changes_nothing, "no_change", "the run already has units='whole'"),
    "a: invents a cause": (A, a_invents_a_cause, "unknown_cause", "is not one of the course's causes"),
    "a: blames weights kept gathered": (A, a_blames_weights_kept_gathered, "wrong_cause",
                                        "the plan keeps reshard_after_forward=True"),
    "b: blames the unit": (B, b_blames_the_unit, "wrong_cause", "the units are blocks here"),
    "b: blames the estimate": (B, b_blames_the_estimate, "wrong_cause", "do halve from 2 ranks to 4"),
    "b: blames collectives": (B, b_blames_collectives, "wrong_cause", "the four blocks and the root"),
    "b: changes the stage": (B, b_changes_the_stage, "symptom_remains", "against"),
    "b: halves the batch": (B, b_halves_the_batch, "symptom_remains", "smaller, not yet half"),
    "b: changes two settings": (B, b_changes_two_settings, "not_one_setting", "change exactly one setting"),
    "c: blames the unit": (C, c_blames_the_unit, "wrong_cause", "18 units"),
    "c: blames activations": (C, c_blames_activations, "wrong_cause", "this is a time symptom"),
    "c: blames prefetch": (C, c_blames_prefetch, "wrong_cause", "the plan keeps prefetch=True"),
    "c: turns prefetch off": (C, c_turns_prefetch_off, "small_units_remain", "Still 18 units"),
    "c: DDP on the same units": (C, c_ddp_on_the_same_units, "small_units_remain", "Still 18 units"),
    "c: ZeRO-2 on the same units": (C, c_zero2_on_the_same_units, "small_units_remain", "Still 18 units"),
    "c: keeps the weights gathered": (C, c_keeps_weights_gathered, "small_units_remain", "Still 18 units"),
    "c: returns the cause only": (C, c_returns_the_cause_only, "not_a_diagnosis", "return two things"),
    "d: blames activations": (D, d_blames_activations, "wrong_cause", "activations are freed"),
    "d: blames collectives": (D, d_blames_collectives, "wrong_cause", "fewer reduce-scatters than usual"),
    "d: blames weights kept gathered": (D, d_blames_weights_kept_gathered, "wrong_cause",
                                        "what the report counts is gradient bytes"),
    "d: changes the stage": (D, d_changes_the_stage, "symptom_remains", "of gradient held between micro-batches"),
    "d: keeps no_sync": (D, d_keeps_no_sync, "no_change", "the run already has sync_every_micro_batch=False"),
    "d: a string for a bool": (D, d_yes_for_a_bool, "not_a_bool", "sync_every_micro_batch is True or False, not 'yes'"),
    "d: units that do not exist": (D, d_bad_units, "bad_value", "cannot be built"),
}
ON_THREE: dict = {}
CORRECT = {
    "a: a list, not a tuple": (A, a_returns_a_list),
    "b: a smaller micro-batch": (B, b_smaller_micro_batch),
    "c: one unit for the model": (C, c_one_unit),
}
