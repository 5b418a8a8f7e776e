from omni_trio.runners import runner_for

runner = runner_for(pipeline)  # any diffusers pipeline you loaded with from_pretrained
