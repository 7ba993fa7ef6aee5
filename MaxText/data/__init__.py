"""Input pipelines. ``make_data_source(config)`` is the one entry the training loop uses."""
