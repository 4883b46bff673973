"""SM90 (Hopper) kernel backends: ``<activation dtype>_<weight dtype>_<output dtype>_cutedsl``."""
