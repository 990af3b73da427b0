"""`dynatree distill`: train a draft for a target that has none.

Two kinds, each in three steps (data -> train -> export):
  lm     a small Llama-style draft LM (`lm_data`, `lm_train`, `lm_export`)
  eagle  a feature head over the target's hidden states (`eagle_data`, `eagle_train`, `eagle_export`)
`chat` holds the instruction prompts and batched chat generation both kinds use, `common` the
learning-rate schedule, batching, atomic writes and resumable checkpoints.
"""
