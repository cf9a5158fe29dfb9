// The BullMQ side of `manage.py bench` (lab/bench/bullmq_level.py runs it, one workload per process).
//
// Usage: node harness.mjs '<json>' with {host, port, db, queue, mode, messages, warmup, concurrency,
// chunk}; mode is "publish" (one awaited Queue.add per job), "bulk" (Queue.addBulk, `chunk` jobs a
// call) or "consume" (a Worker at `concurrency` draining a backlog it queued first, untimed).
//
// The Python side meters Redis (INFO commandstats, INFO cpu) around the measured span only: this
// process prints "mark start" once connections, scripts and warm-up are done, and "mark end" after
// the last measured job, and each time waits for a line on stdin, sent once the snapshot is taken.
// While it waits, a consume holds every processor past the mark (see consume()), so the span holds
// exactly the measured jobs at any concurrency (the Python side checks this by counting them from
// Redis). At the end it prints "result <json>": the jobs and seconds of the span as this process
// saw them (a publish's rate is taken from them).
import { performance } from 'node:perf_hooks';
import { createInterface } from 'node:readline';
import { Queue, Worker } from 'bullmq';

const config = JSON.parse(process.argv[2]);
const connection = { host: config.host, port: config.port, db: config.db };
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();

async function mark(name) {
  process.stdout.write(`mark ${name}\n`);
  const { done } = await lines.next();
  if (done) throw new Error(`stdin closed at mark ${name}`);
}

function body(n) {
  return { n, pad: 'x'.repeat(100) };
}

function jobs(start, count) {
  return Array.from({ length: count }, (_, i) => ({ name: 'noop', data: body(start + i) }));
}

async function addBulk(queue, start, count) {
  for (let at = start; at < start + count; at += config.chunk) {
    await queue.addBulk(jobs(at, Math.min(config.chunk, start + count - at)));
  }
}

async function publish(queue) {
  await queue.waitUntilReady();
  const bulk = config.mode === 'bulk';
  if (bulk) await addBulk(queue, 0, config.warmup);
  else for (let n = 0; n < config.warmup; n++) await queue.add('noop', body(n));
  await mark('start');
  const started = performance.now();
  if (bulk) await addBulk(queue, config.warmup, config.messages);
  else for (let n = config.warmup; n < config.warmup + config.messages; n++) await queue.add('noop', body(n));
  const seconds = (performance.now() - started) / 1000;
  await mark('end');
  return { messages: config.messages, seconds };
}

async function consume(queue) {
  const { warmup, messages, concurrency } = config;
  const last = warmup + messages;
  await addBulk(queue, 0, last + concurrency + Math.min(200, messages)); // A tail keeps the window steady.
  // Gates held in the processor: a job past the warm-up waits for the start mark's answer, a job
  // past the measured ones for the end mark's. A mark is printed when the jobs before it have
  // completed (the 'completed' event follows the job's move in Redis), so at each mark no job can
  // complete until the meter's snapshot is taken, at any concurrency: the span holds exactly
  // `messages` jobs, however few and however many run at once.
  const gate = () => {
    let open;
    const opened = new Promise((resolve) => {
      open = resolve;
    });
    return { opened, open };
  };
  const startGate = gate();
  const endGate = gate();
  let startedJobs = 0;
  let completed = 0;
  let started = 0;
  let result = null;
  let failure = null;
  const ended = gate();
  const startSpan = async () => {
    await mark('start');
    started = performance.now();
    startGate.open();
  };
  const endSpan = async () => {
    const seconds = (performance.now() - started) / 1000;
    await mark('end');
    result = { messages, seconds };
    endGate.open();
    ended.open();
  };
  const fail = (error) => {
    failure = error;
    ended.open();
  };
  if (warmup === 0) await startSpan();
  const worker = new Worker(
    config.queue,
    async () => {
      startedJobs += 1;
      if (startedJobs > last) await endGate.opened;
      else if (startedJobs > warmup) await startGate.opened;
    },
    { connection, concurrency, autorun: true },
  );
  worker.on('completed', () => {
    completed += 1;
    if (completed === warmup) startSpan().catch(fail);
    else if (completed === last) endSpan().catch(fail);
  });
  worker.on('error', (error) => process.stderr.write(`worker error: ${error}\n`));
  await ended.opened;
  await worker.close(true);
  if (failure) throw failure;
  return result;
}

const queue = new Queue(config.queue, { connection, defaultJobOptions: { removeOnComplete: true } });
try {
  const result = config.mode === 'consume' ? await consume(queue) : await publish(queue);
  process.stdout.write(`result ${JSON.stringify(result)}\n`);
} finally {
  await queue.close();
}
process.exit(0);
