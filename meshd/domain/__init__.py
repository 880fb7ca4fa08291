"""The nouns every layer shares: a conversation and its tools, how a request samples,
what it asks of a model, what a model is and what a node offers.

Plain msgspec Structs and pure functions, importing nothing of meshd: the API parses
into them, the wire carries them, placement and the engines read them.

=============  ===============================================================
``chat``       ``ChatTurn``, ``ToolCallTurn``, ``ToolSpec``, ``ToolUse``
``sampling``   ``SamplingChoice`` (named), ``Sampling`` (resolved), the rules
``job``        ``Job``: what a request asks of a model
``reasoning``  ``ThinkChoice`` (asked), ``Thinking`` (set up by stage 0)
``facts``      ``ModelFacts``: a model, read from its file's header
``builds``     ``build_refusal``: which engine builds which model (the rule)
``nodes``      ``Device``, ``NodeResources``: what a node computes with
``text``       ``printable``, ``loggable``: text from the network, safe to show
=============  ===============================================================
"""
