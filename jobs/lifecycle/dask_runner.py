"""The DaskRunner tokenmill runs on: Beam's own (`apache_beam.runners.dask`), with the
four faults that make Beam 2.77's lose or mix up rows put right.

Beam's DaskRunner turns each primitive transform into a `dask.bag` operation (a ParDo
is a `map_partitions`, one partition = one bundle) and computes the result on a
`dask.distributed` scheduler.  As shipped (2.77) it

1. computes only the *last* transform it visits: every other sink of a pipeline with
   several sinks silently never runs (the pipeline still ends DONE);
2. does not separate a ParDo's tagged outputs: every consumer of any output of a
   multi-output ParDo (`.with_outputs(...)`) gets all of its outputs, main and tagged;
3. collects a bundle's outputs *before* `finish_bundle`, so whatever `finish_bundle`
   emits is dropped;
4. re-computes a side input's whole branch inside every task that reads it.

Here a ParDo's partition is a list of `(tag, value)` pairs, taken after
`finish_bundle`; each consumer selects its own tag; every sink (a transform whose
outputs nobody reads) is computed, in one graph, and only a count per partition comes
back to the launcher; a side input's values are computed once (a `dask.delayed` list)
and handed to every task.  Create, GroupByKey, Flatten and the no-ops (Reshuffle) are
Beam's own translations.  The result closes its client when the pipeline ends, and a
failed pipeline's pending tasks are cancelled first.

The scheduler and every worker unpickle the task graph, so all of them need the same
environment as the launcher (this package, Beam, the engine); see docs/ORCHESTRATION.md.
"""

from __future__ import annotations

import dataclasses
import typing as t

import dask
import dask.bag as db
from apache_beam import DoFn, pvalue
from apache_beam.pipeline import AppliedPTransform, PipelineVisitor
from apache_beam.runners.common import DoFnContext, DoFnInvoker, DoFnSignature, Receiver, _OutputHandler  # noqa: PLC2701
from apache_beam.runners.dask import dask_runner as beam_dask
from apache_beam.runners.dask import transform_evaluator as TE
from apache_beam.runners.dask.overrides import dask_overrides
from apache_beam.runners.runner import PipelineState
from apache_beam.transforms.sideinputs import SideInputMap
from apache_beam.utils.windowed_value import WindowedValue


class _TagReceiver(Receiver):
    def __init__(self, tag: str | None, out: list):
        self.tag, self.out = tag, out

    def receive(self, windowed_value: WindowedValue) -> None:
        self.out.append((self.tag, windowed_value.value))


class _Receivers(dict):
    """Output tag → receiver, made on first use; every receiver appends to `out`."""

    def __init__(self):
        super().__init__()
        self.out: list[tuple[str | None, t.Any]] = []

    def __missing__(self, tag):
        self[tag] = _TagReceiver(tag, self.out)
        return self[tag]


@dataclasses.dataclass
class _SideSpec:
    view: type
    options: dict
    window_mapping_fn: t.Any


@dataclasses.dataclass
class BundleFn:
    """One ParDo bundle (a partition): setup, start_bundle, process each element,
    finish_bundle, teardown; returns every output as `(tag, value)` (main: tag None)."""

    label: str
    fn: DoFn
    window_fn: t.Any
    args: list
    kwargs: dict
    sides: list[_SideSpec]

    def __call__(self, items, *side_values):
        receivers = _Receivers()
        # Beam has no public way to run one bundle outside its runners; its own DoFnRunner
        # builds this handler the same way (apache_beam/runners/common.py).
        handler = _OutputHandler(
            window_fn=self.window_fn, main_receivers=receivers[None], tagged_receivers=receivers,
            per_element_output_counter=None, output_batch_converter=None, process_yields_batches=False,
            process_batch_yields_elements=False,
        )
        side_inputs = [
            SideInputMap(s.view, s.options, [TE.get_windowed_value(v, s.window_mapping_fn) for v in values])
            for s, values in zip(self.sides, side_values)
        ]
        invoker = DoFnInvoker.create_invoker(
            DoFnSignature(self.fn), handler, context=DoFnContext(self.label, state=None),
            side_inputs=side_inputs, input_args=self.args, input_kwargs=self.kwargs,
            user_state_context=None, bundle_finalizer_param=DoFn.BundleFinalizerParam(),
        )
        invoker.invoke_setup()
        invoker.invoke_start_bundle()
        for item in items:
            invoker.invoke_process(TE.get_windowed_value(item, self.window_fn))
        invoker.invoke_finish_bundle()
        invoker.invoke_teardown()
        return receivers.out


def _select(partition, tag):
    return [value for out_tag, value in partition if out_tag == tag]


def _count(partition):
    return [sum(1 for _ in partition)]


class ParDo(TE.DaskBagOp):
    """A ParDo as `map_partitions(BundleFn)`; side inputs arrive as computed lists."""

    def apply(self, input_bag, side_inputs=None):
        transform = self.transform
        args, kwargs = transform.raw_side_inputs
        main_input = next(iter(self.applied.main_inputs.values()))
        window_fn = main_input.windowing.windowfn if hasattr(main_input, "windowing") else None
        specs, values = [], []
        for si, bag in side_inputs or []:
            specs.append(_SideSpec(type(si), si._view_options(), si._window_mapping_fn))
            values.append(dask.delayed(list)(bag))  # one computation, handed whole to every task
        fn = BundleFn(transform.label, transform.fn, window_fn, list(args), kwargs, specs)
        return input_bag.map_partitions(fn, *values)


@dataclasses.dataclass
class _Visitor(PipelineVisitor):
    """Beam's DaskBagVisitor, but each consumer of a ParDo selects its own output tag
    and the transforms nobody reads (the sinks) are known."""

    bag_kwargs: dict = dataclasses.field(default_factory=dict)
    bags: dict[AppliedPTransform, db.Bag] = dataclasses.field(default_factory=dict)
    pardos: set = dataclasses.field(default_factory=set)
    """Transforms translated by `ParDo` (their bags hold `(tag, value)` pairs)."""
    read: set = dataclasses.field(default_factory=set)
    """Transforms whose outputs another transform reads (as input or side input)."""

    def bag_of(self, pcoll) -> db.Bag | None:
        producer = pcoll.producer
        bag = self.bags.get(producer)
        if bag is None:
            return None
        self.read.add(producer)
        return bag.map_partitions(_select, pcoll.tag) if producer in self.pardos else bag

    def visit_transform(self, node: AppliedPTransform) -> None:
        # Exact classes, as Beam's visitor: GroupByKey's _GroupAlsoByWindow subclasses
        # ParDo and stays Beam's no-op.
        if node.transform.__class__ is TE.apache_beam.ParDo:
            op = ParDo(node, bag_kwargs=self.bag_kwargs)
            self.pardos.add(node)
        else:
            op = TE.TRANSLATIONS.get(node.transform.__class__, TE.NoOp)(node, bag_kwargs=self.bag_kwargs)
        bags = [b for b in (self.bag_of(i) for i in node.inputs if not isinstance(i, pvalue.PBegin)) if b is not None]
        input_bag: t.Any  # Flatten takes every input's bag, the others one (or None)
        if isinstance(op, TE.Flatten):
            input_bag = bags
        else:
            input_bag = bags[0] if bags else None  # None: a root (Create) under a PBegin
        sides = [(si, self.bag_of(si.pvalue)) for si in node.side_inputs]
        self.bags[node] = op.apply(input_bag=input_bag, side_inputs=sides or None)

    def sinks(self) -> list[db.Bag]:
        return [bag for node, bag in self.bags.items() if node not in self.read and bag is not None]


@dataclasses.dataclass
class DaskRunnerResult(beam_dask.DaskRunnerResult):
    """Beam's result, which also cancels a failed pipeline's pending tasks and closes its client."""

    def wait_until_finish(self, duration=None) -> str:
        from dask.distributed import TimeoutError as DaskTimeout

        try:
            return super().wait_until_finish(duration)
        except DaskTimeout:
            if duration is None:
                raise
            self._state = PipelineState.RUNNING  # still running after `duration` ms: Beam's contract
            return self._state
        except BaseException:
            self.client.cancel(self.futures)
            raise
        finally:
            if self._state in (PipelineState.DONE, PipelineState.FAILED):
                self.client.close()


class DaskRunner(beam_dask.DaskRunner):
    """Beam's DaskRunner with every sink computed, tagged outputs kept apart,
    finish_bundle outputs kept and side inputs computed once."""

    def run_pipeline(self, pipeline, options):
        import dask.distributed as ddist

        dask_options = options.view_as(beam_dask.DaskOptions).get_all_options(drop_default=True, current_only=True)
        bag_kwargs = beam_dask.DaskOptions._extract_bag_kwargs(dask_options)
        client = ddist.Client(**dask_options)
        try:
            pipeline.replace_all(dask_overrides())
            visitor = _Visitor(bag_kwargs)
            pipeline.visit(visitor)
            sinks = [bag.map_partitions(_count) for bag in visitor.sinks()]
            futures = client.compute(sinks) if sinks else []  # one graph: shared steps run once
        except BaseException:  # a transform it cannot translate (a Read source, Impulse)
            client.close()
            raise
        return DaskRunnerResult(client, futures)
