// The answer's audio, played as it arrives. The page's player AudioContext runs at 24 kHz, the
// Realtime API's rate, so chunks (Float32Array, each tagged with its response id) play as they
// are. Counts the samples each response has played and reports them to the page:
//   in:  {type: 'chunk', id, samples}   {type: 'clear'}
//   out: {type: 'played', counts: {id: samples played so far}, busy, cleared}
const REPORT_EVERY = 8; // render quanta (128 samples each): a report about every 43 ms

class Player extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = []; // {id, samples, offset}
    this.counts = {}; // response id -> samples played
    this.changed = false;
    this.quanta = 0;
    this.port.onmessage = (event) => this.receive(event.data);
  }

  receive(message) {
    if (message.type === 'chunk') {
      this.queue.push({id: message.id, samples: message.samples, offset: 0});
    } else if (message.type === 'clear') {
      this.queue = [];
      this.report(true);
    }
  }

  report(cleared = false) {
    this.port.postMessage({type: 'played', counts: {...this.counts}, busy: this.queue.length > 0,
                           cleared});
    this.changed = false;
    this.quanta = 0;
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    let k = 0;
    while (k < out.length && this.queue.length > 0) {
      const chunk = this.queue[0];
      const n = Math.min(out.length - k, chunk.samples.length - chunk.offset);
      out.set(chunk.samples.subarray(chunk.offset, chunk.offset + n), k);
      k += n;
      chunk.offset += n;
      this.counts[chunk.id] = (this.counts[chunk.id] || 0) + n;
      this.changed = true;
      if (chunk.offset === chunk.samples.length) this.queue.shift();
    }
    out.fill(0, k);
    this.quanta += 1;
    // Report as it plays, and at once when the queue runs dry (the answer has played out).
    if (this.changed && (this.quanta >= REPORT_EVERY || this.queue.length === 0)) this.report();
    return true;
  }
}

registerProcessor('omni-pd-player', Player);
