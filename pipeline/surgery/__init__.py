"""Model surgery shared by training and the variant builders: structured pruning with least-squares repair, the
distillation student cut from its teacher, the distillation losses and QAT's fake quantizers. Imports the
runtimes layer and below, never training, builders, evaluation or deployment."""
