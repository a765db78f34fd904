"""The pipeline-stage pass: schedules (:mod:`.schedules`), splitting a loss around its scanned
layer stack (:mod:`.split`), and emitting the pipelined value-and-grad (:mod:`.emit`)."""
