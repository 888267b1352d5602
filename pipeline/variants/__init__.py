"""The builders: each variant's recipe (export, quantize, prune, distilled student, TensorRT) writing its variant
directory. Imports training, surgery and runtimes; evaluation and deployment never import a builder."""
