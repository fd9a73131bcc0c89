// A Realtime API websocket from a browser. Browsers cannot set headers on a websocket, so the
// API key (where the server wants one) goes as the subprotocol `openai-insecure-api-key.<key>`,
// offered with `realtime`, as OpenAI's Realtime API takes it from browsers. A refused key comes
// back as an `error` event (code invalid_api_key) and a close with 1008.
const KEY_PREFIX = 'openai-insecure-api-key.';

export function realtimeUrl(path, model) {
  const url = new URL(path, window.location.href);
  url.protocol = url.protocol === 'https:' ? 'wss:' : 'ws:';
  if (model) url.searchParams.set('model', model);
  return url.href;
}

export class Refused extends Error {
  constructor(message, code) {
    super(message);
    this.name = 'Refused';
    this.code = code || null;
  }
}

export class RealtimeConnection {
  // Resolves once the session is created; rejects (Refused) with the server's reason if the
  // socket closes before that. `onEvent(event)` sees every server event from session.created
  // on; `onClose(CloseEvent)` a close after that.
  static open(url, apiKey, onEvent, onClose) {
    return new Promise((resolve, reject) => {
      const protocols = ['realtime'];
      if (apiKey) protocols.push(KEY_PREFIX + apiKey);
      let socket;
      try {
        socket = new WebSocket(url, protocols);
      } catch (error) { // SyntaxError: a key with characters a subprotocol cannot carry
        reject(new Refused(`cannot offer that API key as a websocket subprotocol: ${error.message}`));
        return;
      }
      const connection = new RealtimeConnection(socket);
      let refusal = null;
      socket.onmessage = (message) => {
        const event = JSON.parse(message.data);
        if (connection.opened) {
          onEvent(event);
        } else if (event.type === 'session.created') {
          connection.opened = true;
          resolve(connection);
          onEvent(event);
        } else if (event.type === 'error') {
          refusal = event.error;
        }
      };
      socket.onclose = (close) => {
        if (connection.opened) {
          onClose(close);
        } else if (refusal) {
          reject(new Refused(refusal.message, refusal.code));
        } else {
          reject(new Refused(`the server closed the connection (code ${close.code}` +
                             `${close.reason ? ': ' + close.reason : ''}); is it running?`));
        }
      };
    });
  }

  constructor(socket) {
    this.socket = socket;
    this.opened = false;
    this.sent = 0;
  }

  // Returns the event's id, so that an error event can be matched to what caused it.
  send(event) {
    const eventId = `page_${++this.sent}`;
    this.socket.send(JSON.stringify({event_id: eventId, ...event}));
    return eventId;
  }

  close() {
    this.socket.onclose = null;
    this.socket.onmessage = null;
    this.socket.close(1000, 'bye');
  }
}
