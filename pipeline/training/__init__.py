"""Training: finetune, the distillation student's and QAT's training loops, checkpoints and resume. Imports the
layers below (surgery, runtimes, modeling, data, core), never a builder, evaluation or deployment."""
